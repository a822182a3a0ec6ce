"""`meshspeed eval`: loss and perplexity of a checkpoint on held-out data, under any layout."""

from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """examples:
  meshspeed eval --checkpoint runs/tiny                       # the run's own validation data and layout
  meshspeed eval --checkpoint runs/tiny --nproc 2 --parallel.tp 2 --parallel.dp 1
  meshspeed eval --checkpoint runs/tiny/step-000300 --data.path notes.txt --train.eval_batches 8
  meshspeed eval --checkpoint ~/Llama-3.2-1B --data.path tokens.bin --data.format uint32 \\
      --data.tokenizer ~/Llama-3.2-1B --train.seq_len 1024     # a Hugging Face directory
  meshspeed eval --checkpoint runs/dpo --pairs held_out.jsonl  # preference accuracy and margin
  meshspeed eval --checkpoint runs/dpo --pairs held_out.jsonl --reference runs/sft --nproc 2 --parallel.tp 2

The loss is the trainer's validation loss (the same held-out tokens: the last part of a token
file, or the validation files of a text corpus; train.eval_batches batches of
train.global_batch_size sequences), computed by the trainer's own code under the layout given.
Settings default to what the checkpoint's run recorded; --section.key overrides them.

--pairs FILE scores preference pairs instead (a JSON-lines file: every pair; a prepared pairs
record file or a `data prepare --kind arith` directory: its validation split): the share of pairs
whose chosen answer's reward beats the rejected one's, and the mean margin, rewards being
dpo.beta × (policy − reference) summed log-probabilities. --reference init (default) is the run's
starting point: its recorded model.init_from, else its seeded initialisation.
"""


def register(sub) -> None:
    from meshspeed.plan import config

    p = sub.add_parser(
        "eval",
        help="loss and perplexity of a checkpoint (any layout)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a meshspeed checkpoint, a run directory (its newest checkpoint) or a Hugging Face directory",
    )
    p.add_argument("--json", metavar="FILE", help='also write {"loss", "perplexity", "tokens", ...} here')
    p.add_argument("--config", metavar="FILE.toml", help="settings instead of the checkpoint's recorded ones")
    p.add_argument(
        "--pairs",
        metavar="FILE",
        help="print preference accuracy and mean margin on these held-out pairs (JSON lines: every "
        "pair; a pairs record file or an arith directory: its validation split)",
    )
    p.add_argument(
        "--reference",
        default="init",
        metavar="init|DIR",
        help="--pairs: the reference model; init (default) = the run's starting point (its recorded "
        "model.init_from, else its seeded initialisation), or a checkpoint / Hugging Face directory",
    )
    config.add_arguments(p)
    p.set_defaults(func=run)


def check_data_fits(cfg, dp: int) -> None:
    """Eval scores the validation split only (a lone file's last 2%): refuse, before any worker
    starts, data whose split cannot hold train.eval_batches batches, in one line that says how
    much data would do and which smaller settings this data holds (before: a worker's error,
    after every worker had started and loaded the model)."""
    from meshspeed.data.corpus import DataError, load_corpus
    from meshspeed.data.loader import GlobalBatchLoader, retokenize
    from meshspeed.data.tokenizer import ByteTokenizer, load_tokenizer

    d, t = cfg.data, cfg.train
    corpus = load_corpus(d.path, d.format, max_mb=d.max_mb)
    tok = load_tokenizer(d.tokenizer)
    val = corpus.val if d.format != "text" or isinstance(tok, ByteTokenizer) else retokenize(corpus.val, tok)
    GlobalBatchLoader(corpus.train, t.seq_len, t.global_batch_size, t.micro_batch_size, 0, dp)  # its line
    n, s, g, b = val.numel(), t.seq_len, t.global_batch_size, t.eval_batches
    windows, need = max(0, n - 1) // s, g * b
    if windows >= need:
        return
    tokens = need * s + 1
    where = f"data.path={d.path!r}" if d.path else "the built-in corpus"
    size = ""
    if d.path and os.path.isfile(d.path) and n:  # the split is a fixed fraction of the file
        want = os.path.getsize(d.path) * tokens / n
        size = (
            f" (a file of about {want / 1e3:,.0f} KB)"
            if want < 1e6
            else f" (a file of about {want / 1e6:,.1f} MB)"
        )
    step = t.micro_batch_size * dp
    if windows >= g:
        fix = f"--train.eval_batches {windows // g}"
    elif windows >= step:
        fix = f"--train.global_batch_size {windows // step * step} --train.eval_batches 1"
    elif n - 1 >= g:
        fix = f"--train.seq_len {(n - 1) // g} --train.eval_batches 1"
    else:
        fix = None
    raise DataError(
        f"{where} is too small to evaluate: its validation split holds {n:,} tokens = {windows} "
        f"sequences of train.seq_len={s}, and train.eval_batches={b} × train.global_batch_size={g} "
        f"= {need} sequences need {tokens:,} tokens{size}; give more data"
        + (f", or use {fix} (what this data holds)" if fix else "")
    )


def run_pairs(args, quiet: bool) -> int:
    """--pairs: the policy and its reference scored on the pairs (train/evaluate_pairs.py)."""
    from meshspeed.comm import ConfigError, launch, launched
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan, world_size
    from meshspeed.train.evaluate_pairs import pairs_configs, pairs_worker

    try:
        if not os.path.exists(args.pairs):
            raise ConfigError(f"--pairs={args.pairs!r} does not exist; give a JSON-lines file of pairs")
        overrides = config.overrides_from_args(args)
        policy, ref = pairs_configs(args.checkpoint, args.reference, args.pairs, args.config, overrides)
        plan = make_plan(policy, world_size(policy), ranks=False)  # every check, before any worker
        make_plan(ref, world_size(ref), ranks=False)
        if not launched():
            launch.check_workers(policy.nproc)
    except ConfigError as err:
        if not quiet:
            print(f"meshspeed eval: {err}", file=sys.stderr)
        return 2
    job = (policy.to_dict(), ref.to_dict(), plan.device, args.pairs, args.json)
    if launched():
        return launch.run_worker(pairs_worker, job)
    preload = ("meshspeed.train.trainer",)
    return launch.spawn(pairs_worker, policy.nproc, job, fork_ok=plan.device == "cpu", preload=preload)


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch, launched
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan, world_size
    from meshspeed.train.evaluate import eval_config, worker

    quiet = launched() and os.environ.get("RANK", "0") != "0"
    if args.pairs:
        return run_pairs(args, quiet)
    try:
        overrides = config.overrides_from_args(args)
        cfg = eval_config(args.checkpoint, args.config, overrides)
        plan = make_plan(cfg, world_size(cfg), ranks=False)  # every check, before any worker starts
        if not launched():
            launch.check_workers(cfg.nproc)
        check_data_fits(cfg, plan.dims["dp"])
    except ConfigError as err:
        if not quiet:
            print(f"meshspeed eval: {err}", file=sys.stderr)
        return 2
    if not quiet:
        for w in plan.warnings:  # the device choice's notice among them
            print(f"meshspeed eval: warning: {w}", file=sys.stderr, flush=True)
    if launched():
        return launch.run_worker(worker, (plan.to_dict(), args.json))
    preload = ("meshspeed.train.trainer",)  # a CPU job forks its workers from here (launch.spawn)
    return launch.spawn(
        worker, cfg.nproc, (plan.to_dict(), args.json), fork_ok=plan.device == "cpu", preload=preload
    )
