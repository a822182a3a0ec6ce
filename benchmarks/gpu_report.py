"""One command on a GPU machine that says whether everything meshspeed does works there, and at
what cost: writes gpu_report.md and gpu_report.json, its steps inside --budget (330 s: the report
in under 6 minutes; steps past it are listed as not run).

  tests     every test with a CUDA path (found by grepping tests/ for "cuda", then kept when a
            skip reason, a parameter, the module or the test's own source names CUDA): counts
  commands  each command end to end: train (the README's default command, and --nproc 1 at
            bf16 on the GPU), resume (same device, then CPU and back), generate (the command, and
            benchmarks/generate.py: tokens/s against transformers, tokens equal), eval, convert
            (export, import, export: bit for bit), --dry-run
  trainer   the trainer against a plain loop and transformers (benchmarks/trainer_overhead.py)
  features  each [memory] feature, 2:4 sparsity and accumulation 8, one trainer step each on
            one GPU: step time against the plain step, torch.cuda.max_memory_allocated against
            the run plan's estimate
  cslt      benchmarks/cslt_probe.py: whether the compiled 2:4 compression kernel writes
            torch._cslt_compress's bytes, and if not which part differs (Triton IR into --out/cslt_ir)
  sparse    benchmarks/sparse_linear.py, and benchmarks/cslt_capture.py (cuSPARSELt's compressed
            bytes of known matrices, into --out, for the CPU to check the layout against)
and what it could not run, with why. A step that fails is a row that says so, never the end of
the report.

    python -m benchmarks.gpu_report [--out DIR] [--skip tests,sparse] [--budget 330]
    python -m benchmarks.gpu_report --dry         # what would run; writes the files; no GPU needed
    python -m benchmarks.gpu_report --cpu-smoke   # every step at toy sizes on the CPU
Without CUDA (and without --dry / --cpu-smoke) it says so in one line and exits 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.gpu_features import COMMON, FEATURE_BASE, FEATURES
from benchmarks.gpu_tests import cuda_test_files, junit_counts, selection_args
from benchmarks.harness import ROOT, clean_env, parser

SECTIONS = ("trainer", "cslt", "tests", "commands", "features", "sparse")  # the open issue's figures first


# ------------------------------------------------------------------------------ running things
def sh(args: list[str], timeout: float, env: dict | None = None) -> dict:
    """`python ARGS` from the repository root; rc is "timeout" when it ran out of time (what it
    printed until then is kept)."""
    env = {
        **clean_env(),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:

        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        rc, out, err = "timeout", text(e.stdout), text(e.stderr)
    return {"rc": rc, "s": round(time.perf_counter() - t0, 1), "out": out, "err": err}


def tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def grep(text: str, pattern: str) -> str:
    found = [line.strip() for line in text.splitlines() if re.search(pattern, line)]
    return found[-1] if found else ""


class Report:
    def __init__(self, mode: str, budget: float, out: str = "."):
        self.mode, self.out, self.t0 = mode, out, time.perf_counter()  # out: where files go
        self.slow = 5 if mode == "cpu-smoke" else 1  # time limits stretched for a (shared) laptop
        self.budget = budget * self.slow
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        self.data = {"mode": mode, "device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda}
        self.data.update(tests={}, commands=[], trainer={}, features=[], sparse=[], not_run=[])

    def sh(self, what: str, args: list[str], timeout: float, env: dict | None = None) -> dict | None:
        """sh() within the step's own limit and what is left of --budget (the report must be
        written before whoever runs it stops waiting); None, listed as not run, past it."""
        left = self.budget - (time.perf_counter() - self.t0)
        if left < 5:
            return self.not_run(what, f"over --budget {self.budget / self.slow:g} s")
        return sh(args, min(timeout * self.slow, left), env)

    def say(self, msg: str) -> None:
        print(f"[t+{time.perf_counter() - self.t0:.0f}s] {msg}", flush=True)

    def not_run(self, what: str, why: str) -> None:
        self.data["not_run"].append(f"{what}: {why}")
        self.say(f"not run: {what}: {why}")


# ------------------------------------------------------------------------------ CUDA-path tests
def tests(rep: Report, work: str) -> None:
    files = cuda_test_files()
    rep.data["tests"] = {"files": files}
    if rep.mode == "dry":
        return rep.not_run("CUDA-path tests", f"--dry: would run the CUDA-path tests of {len(files)} files")
    if rep.mode == "cpu-smoke":  # the whole selection takes minutes on a CPU: one file's CUDA tests
        files = ["tests/plan/test_device.py", "-k", "comm_init"]
    xml = os.path.join(work, "tests.xml")
    r = rep.sh("CUDA-path tests", selection_args(xml) + files, 120, env={"GPU_REPORT_SELECT": "1"})
    if r is None:
        return
    rep.data["tests"].update(junit_counts(xml, r["out"]), seconds=r["s"], rc=r["rc"])
    rep.data["tests"]["summary"] = tail(r["out"], 1)
    rep.say(f"tests: {rep.data['tests']['summary']} ({r['s']} s)")


# ------------------------------------------------------------------------------ commands
def commands(rep: Report, work: str) -> None:
    cpu = rep.mode == "cpu-smoke"  # --dry lists what the GPU run does
    dev, steps, more = ("cpu", 2, 1) if cpu else ("cuda", 10, 5)
    run, first = os.path.join(work, "run"), os.path.join(work, "readme")
    one = ["--nproc", "1", "--parallel.tp", "1", "--train.dtype", "bfloat16", "--run.dir", run]

    def cmd(name: str, args: list[str], timeout: float, note, ok=lambda r: True) -> dict:
        if rep.mode == "dry":
            rep.data["commands"].append({"command": name, "ok": "(dry)", "note": "python " + " ".join(args)})
            return {}
        r = rep.sh(name, args, timeout)
        if r is None:
            return {}
        good = r["rc"] == 0 and ok(r)
        row = {"command": name, "argv": " ".join(args), "ok": good, "rc": r["rc"], "seconds": r["s"]}
        row["note"] = note(r) if good else tail(r["err"] or r["out"], 3)
        if r["rc"] == "timeout":
            row["note"] = f"stopped after {r['s']} s; {row['note']}"
        rep.data["commands"].append(row)
        rep.say(f"{name}: {'ok' if good else 'FAILED'} ({r['s']} s) {row['note'][:160]}")
        return r

    ms = ["-m", "meshspeed"]

    def dev_line(r):
        return grep(r["out"], r"^\s+device ")

    cmd("train --dry-run (README default)", ms + ["train", "--dry-run", "--run.dir", first], 60, dev_line)
    cmd("train --dry-run --nproc 1", ms + ["train", "--dry-run"] + one, 60, dev_line)
    readme = ["train", "--train.steps", str(steps), "--run.dir", first]

    def notice(r):
        return grep(r["err"], "run.device") or tail(r["out"], 1)

    cmd("train (README default)", ms + readme, 90, notice)

    def tps(r):
        return grep(r["out"] + r["err"], "tokens/s|resumed") or grep(r["out"], "final train loss")

    train = ms + ["train", "--checkpoint.interval", str(steps)] + one
    cmd(f"train --nproc 1 bf16 on {dev}", train + ["--train.steps", str(steps), "--run.device", dev], 60, tps)

    def resumed(r):
        return "resumed from step" in r["out"] + r["err"]

    total = steps
    # the same device; then, on a GPU, the checkpoint saved on CUDA on the CPU and the CPU's on CUDA
    for i, to in enumerate((dev,) if cpu else (dev, "cpu", "cuda")):
        total += 2 if i else more
        again = train + ["--checkpoint.resume", "latest", "--train.steps", str(total), "--run.device", to]
        cmd(f"resume on {to}", again, 60, tps, resumed)
    new = "4" if cpu else "32"
    gen = ["generate", "--checkpoint", run, "--max-new-tokens", new, *"--prompt def --prompt import".split()]
    cmd(f"generate on {dev}", ms + gen + ["--run.device", dev], 60, lambda r: grep(r["out"], "decode"))
    gj = os.path.join(work, "generate.json")
    toy = "--hidden 64 --layers 2 --batch 2 --new 4 --rounds 1 --prompt-len 8".split()
    bench = ["-m", "benchmarks.generate", "--device", dev, "--json", gj] + (toy if cpu else [])

    def rates(r):
        return "; ".join(grep(r["out"], p) for p in ("tokens equal", "^prefill ", "^decode "))

    cmd("generate vs transformers", bench, 90, rates)
    ej = os.path.join(work, "eval.json")
    evals = [
        "eval",
        "--checkpoint",
        run,
        *"--nproc 1 --parallel.tp 1".split(),
        "--run.device",
        dev,
        "--json",
        ej,
    ]
    cmd(f"eval on {dev}", ms + evals, 60, lambda r: grep(r["out"], "meshspeed eval"))
    hf1, ck2, hf2 = (os.path.join(work, n) for n in ("hf1", "ck2", "hf2"))

    def last(r):
        return tail(r["out"], 1)

    chain = [
        ("convert --to-hf", ["--checkpoint", run, "--to-hf", hf1], last, lambda r: True),
        ("convert --from-hf", ["--from-hf", hf1, "--out", ck2], last, lambda r: True),
        (
            "convert --to-hf again",
            ["--checkpoint", ck2, "--to-hf", hf2],
            lambda r: same_files(hf1, hf2),
            lambda r: same_files(hf1, hf2).startswith("bit"),
        ),
    ]
    for name, args, note, check in chain:  # export, import, export: the two exports bit for bit
        if cmd(name, ms + ["convert", *args], 60, note, check).get("rc") != 0 and rep.mode != "dry":
            break


def same_files(a: str, b: str) -> str:
    from meshspeed.checkpoint.safetensors_io import read_safetensors

    def read(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(read_safetensors(os.path.join(d, f))[0])
        return out

    x, y = read(a), read(b)
    same = sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    return f"bit for bit: {len(x)} tensors" if same else f"DIFFERENT: {sorted(set(x) ^ set(y))[:4]}"


# ------------------------------------------------------------------------------ trainer, sparse
def trainer(rep: Report, work: str) -> None:
    if not os.path.exists(os.path.join(ROOT, "benchmarks", "trainer_overhead.py")):
        return rep.not_run(
            "trainer vs plain loop and transformers", "benchmarks/trainer_overhead.py does not exist"
        )
    if rep.mode == "dry":
        return rep.not_run("trainer vs plain loop and transformers", "--dry")
    # issue 24's 1.92B configuration (llama3-8b at 4 layers, 2 x 2048 tokens); the fused-kernels
    # side is left out there: five sides of that size do not fit one GPU together
    size = (
        "--device cuda --presets llama3-8b --layers 4 --seq-len 2048 --batch 2 --dtypes bfloat16 "
        "--sides plain,transformers,eager,compile --rounds 2"
    )
    if rep.mode == "cpu-smoke":
        size = "--presets tiny --dtypes float32 --steps 2 --rounds 1"
    args = ["-m", "benchmarks.trainer_overhead", *size.split(), "--profile", "eager"]
    args += ["--optimizer-alone", "false"]
    r = rep.sh("benchmarks/trainer_overhead.py", args, 180)
    if r is None:
        return
    rep.data["trainer"] = dict(rc=r["rc"], seconds=r["s"], table=tail(r["out"], 60), err=tail(r["err"], 3))
    rep.say(f"trainer_overhead: rc {r['rc']} ({r['s']} s)")
    # the step-cost model's prediction of the same sides (counted on meta), beside the measurement
    model = "--preset tiny --layers 2 --batch 2 --seq-len 64" if rep.mode == "cpu-smoke" else ""
    cost = ["-m", "benchmarks.step_cost", *model.split(), "--sides", "plain,autocast,eager"]
    cost += ["--parent", "none"]
    c = rep.sh("benchmarks/step_cost.py", cost, 120)
    if c is not None:
        rep.data["trainer"]["predicted"] = tail(c["out"] if c["rc"] == 0 else c["err"], 24)


def sparse(rep: Report, work: str) -> None:
    smoke, out = rep.mode == "cpu-smoke", rep.out
    # the whole trainer step with 2:4 against the dense one is the features section's "2:4 sparsity"
    # row; benchmarks/sparse_step.py times the mask updates' CPU-side cost and stays off the GPU list.
    # cslt_capture saves cuSPARSELt's own compressed bytes for the CPU to check the layout against.
    runs = [
        ("cslt_capture", ["--out", out], 30),
        ("sparse_linear", ["--iters", "10"] if not smoke else ["--cpu", "--iters", "1"], 100),
    ]
    for name, args, timeout in runs:
        if rep.mode == "dry" or (smoke and name == "cslt_capture"):
            rep.not_run(f"benchmarks/{name}.py", "--dry" if rep.mode == "dry" else "needs CUDA")
            continue
        r = rep.sh(f"benchmarks/{name}.py", ["-m", f"benchmarks.{name}", *args], timeout)
        if r is None:
            continue
        row = dict(benchmark=name, args=args, rc=r["rc"], seconds=r["s"], table=tail(r["out"], 24))
        rep.data["sparse"].append({**row, "err": tail(r["err"], 3)})
        rep.say(f"{name}: rc {r['rc']} ({r['s']} s)")


def cslt(rep: Report, work: str) -> None:
    # before the tests: the kernels it compiles are in Triton's cache when test_kernels.py runs
    if rep.mode == "dry":
        return rep.not_run("benchmarks/cslt_probe.py", "--dry")
    env = {"OUT": rep.out, "TRITON_DUMP_DIR": os.path.join(rep.out, "cslt_ir")}  # CPU: a dry run
    r = rep.sh("benchmarks/cslt_probe.py", ["-m", "benchmarks.cslt_probe"], 150, env=env)
    if r is None:
        return
    rep.data["cslt"] = dict(rc=r["rc"], seconds=r["s"], lines=tail(r["out"], 60), err=tail(r["err"], 3))
    rep.say(f"cslt_probe: rc {r['rc']} ({r['s']} s)")


# ------------------------------------------------------------------------------ memory features
def features(rep: Report, work: str) -> None:
    cuda = rep.mode != "cpu-smoke"
    dev = "cuda" if cuda else "cpu"
    cases = FEATURES if cuda else [FEATURES[0], FEATURES[4], FEATURES[3]]  # plain, chunked loss, full
    if rep.mode == "dry":
        return rep.not_run("memory features", "--dry: would time " + ", ".join(n for n, _ in cases))
    spec = {"device": dev, "base": FEATURE_BASE[dev] + COMMON, "cases": cases, "steps": 6 if cuda else 3}
    r = rep.sh("memory features", ["-m", "benchmarks.gpu_features", json.dumps(spec)], 120)
    if r is None:
        return
    rows = [json.loads(line[8:]) for line in r["out"].splitlines() if line.startswith("FEATURE ")]
    rep.data["features"] = rows
    for name, _ in cases[len(rows) :]:
        rep.not_run(f"feature {name}", f"the worker stopped (rc {r['rc']}): {tail(r['err'], 1)}")
    rep.say(f"features: {len(rows)} of {len(cases)} ({r['s']} s)")


RUNNERS = {"tests": tests, "commands": commands, "trainer": trainer, "features": features, "sparse": sparse}
RUNNERS["cslt"] = cslt


# ------------------------------------------------------------------------------ the report
def markdown(d: dict) -> str:
    def gib(n):
        return f"{n / 2**30:.2f}" if n else "n/a"

    lines = [
        f"# meshspeed GPU report: {d['device']}",
        "",
        f"torch {d['torch']}, CUDA {d['cuda']}, mode {d['mode']}, {d['seconds']:.0f} s",
        "",
    ]
    t = d["tests"]
    lines += ["## CUDA-path tests", ""]
    if "passed" in t:
        lines += [
            f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in {t['seconds']} s "
            f"(from {len(t['files'])} files that mention CUDA)"
            + (": the run was stopped, these are the counts until then" if t.get("incomplete") else ""),
            "",
        ]
        for f in t["failed_tests"]:
            lines += [f"- failed: {f}"]
            if t.get("why", {}).get(f):
                lines += ["", "  ```", *("  " + x for x in t["why"][f].splitlines()), "  ```"]
        lines += [""] * bool(t["failed_tests"])
    lines += ["## Commands on one GPU", "", "| command | ok | s | note |", "|---|---|---|---|"]
    for c in d["commands"]:
        note = (c.get("note") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| `{c['command']}` | {c['ok']} | {c.get('seconds', '')} | {note} |")
    if d["trainer"]:
        lines += ["", "## Trainer vs plain loop and transformers", "", "```", d["trainer"]["table"], "```"]
        if d["trainer"].get("predicted"):  # benchmarks/step_cost.py: what the counted bytes predicted
            lines += ["", "Predicted by the step-cost model:", "", "```", d["trainer"]["predicted"], "```"]
    if d["features"]:
        ms = {f["name"]: f["step_ms"] for f in d["features"] if "step_ms" in f}
        lines += [
            "",
            "## Memory features (one trainer step each; × plain: against plain at the same accumulation)",
            "",
            "| feature | step ms | × plain | peak GiB | plan estimate GiB | peak/estimate | loss |",
            "|---|---|---|---|---|---|---|",
        ]
        for f in d["features"]:
            if "error" in f:
                lines.append(f"| {f['name']} | failed: {f['error'][:120]} | | | | | |")
                continue
            ratio = f"{f['peak'] / f['estimate']:.2f}" if f["peak"] and f["estimate"] else "n/a"
            base = ms.get("plain, accumulation 8" if f["name"].endswith("accumulation 8") else "plain")
            x = f"{f['step_ms'] / base:.2f}" if base else "n/a"
            lines.append(
                f"| {f['name']} | {f['step_ms']:.1f} | {x} | {gib(f['peak'])} | {gib(f['estimate'])} | "
                f"{ratio} | {f['loss']:.4f} |"
            )
    if d.get("cslt"):
        c = d["cslt"]
        lines += ["", f"## benchmarks/cslt_probe.py (rc {c['rc']}, {c['seconds']} s)", "", "```"]
        lines += [c["lines"] or c["err"], "```"]
    for s in d["sparse"]:
        lines += [
            "",
            f"## benchmarks/{s['benchmark']}.py {' '.join(s['args'])} (rc {s['rc']})",
            "",
            "```",
            s["table"] or s["err"],
            "```",
        ]
    lines += ["", "## Not run", ""] + [f"- {n}" for n in d["not_run"] or ["nothing"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--out", default=os.environ.get("OUT", "."), help="where the two files go (default $OUT or .)"
    )
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    p.add_argument("--dry", action="store_true", help="list what would run; run nothing")
    p.add_argument(
        "--budget",
        type=float,
        default=330,
        help="seconds for every step together (default 330: the report in under 6 minutes); a step "
        "gets what is left, and those past it are listed as not run (x5 with --cpu-smoke)",
    )
    p.add_argument("--cpu-smoke", action="store_true", help="every step at toy sizes on the CPU")
    a = p.parse_args(argv)
    if bad := set(filter(None, a.skip.split(","))) - set(SECTIONS):
        p.error(f"--skip {','.join(sorted(bad))}: choose among {', '.join(SECTIONS)}")
    mode = "dry" if a.dry else "cpu-smoke" if a.cpu_smoke else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        print(
            "gpu_report: no CUDA device here (torch.cuda.is_available() is False); nothing to report "
            "(--dry or --cpu-smoke check the script itself)"
        )
        return 0
    rep = Report(mode, a.budget, a.out)
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_report-") as work:
        for name in SECTIONS:
            if name in a.skip.split(","):
                rep.not_run(name, "--skip")
                continue
            rep.say(f"== {name}")
            RUNNERS[name](rep, work)
    rep.data["seconds"] = time.perf_counter() - rep.t0
    with open(os.path.join(a.out, "gpu_report.json"), "w") as f:
        json.dump(rep.data, f, indent=1)
    text = markdown(rep.data)
    with open(os.path.join(a.out, "gpu_report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
