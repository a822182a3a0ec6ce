"""The configuration's sections: one dataclass per TOML table, each field with its help text.

Kept apart from `config.py` (load, coerce, validate, argparse) so that adding a setting is one
field here, with its help and choices, and the `--help` text is built from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshspeed.parallel.pipeline.schedules import SCHEDULES as PP_SCHEDULES


def opt(default: Any, help: str, choices: tuple | None = None):
    """A config field with its help text (and the values it accepts, when it is a choice)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelSection:
    preset: str = opt("tiny", "model preset (see meshspeed.models.preset_names())")
    n_layers: int = opt(0, "override the preset's layer count (0 = keep)")
    dim: int = opt(0, "override the preset's hidden size (0 = keep)")
    n_heads: int = opt(0, "override the preset's attention heads (0 = keep)")
    n_kv_heads: int = opt(0, "override the preset's key/value heads (0 = keep)")
    init_from: str = opt(
        "",
        "start from this Hugging Face model directory (config.json + safetensors; "
        "each rank reads only its slices) or meshspeed checkpoint: architecture and "
        "weights come from it and model.preset is not used",
    )

    def overrides(self) -> dict:
        return {k: v for k in ("n_layers", "dim", "n_heads", "n_kv_heads") if (v := getattr(self, k))}


@dataclass
class ParallelSection:
    dp: int = opt(0, "data-parallel degree (0 = whatever the world size leaves after tp and pp)")
    tp: int = opt(2, "tensor-parallel degree (innermost: keep it inside a node)")
    pp: int = opt(1, "pipeline-parallel degree")
    sequence_parallel: bool = opt(False, "shard norm/dropout activations along the sequence over tp")
    zero: int = opt(
        0,
        "ZeRO stage: 0 off, 1 shard optimizer state, 2 also shard gradients, 3 also shard parameters "
        "(each block all-gathered just before its forward and backward, the next one prefetched; "
        "with pp a stage's blocks stay gathered through the step; not with sparsity)",
        (0, 1, 2, 3),
    )
    zero_prefetch: bool = opt(
        False,
        "ZeRO 1/2: gather the updated parameters during the next forward, bucket by bucket, "
        "instead of blocking at the end of the step (exact; off while sparsity is on)",
    )
    bucket_mb: float = opt(25.0, "gradient bucket size for overlapped data-parallel reduction (MB)")
    vpp: int = opt(
        1, "model chunks (virtual pipeline stages) per pipeline rank; ≥ 2 for the interleaved schedules"
    )
    pp_schedule: str = opt(
        "1f1b", "pipeline schedule (see `meshspeed pipeline show --help`)", tuple(PP_SCHEDULES)
    )
    pp_layout: str = opt(
        "", "layers per pipeline stage, e.g. 'E,t*8|t*8|t*8|t*7,L' or '8,8,8,7' (empty = even split)"
    )
    pp_overlap: bool = opt(
        False,
        "run the schedule's independent forward/backward pairs of one rank as one step each, the "
        "backward on a helper thread, handing over at the MoE all-to-alls (DualPipeV's overlap; "
        "same numbers; needs parallel.pp > 1)",
    )
    pp_trace: bool = opt(
        False,
        "record the last step's pipeline timeline: run.dir/pp_trace.json + PNGs, measured next to simulated",
    )
    cp: int = opt(1, "context-parallel degree: ranks sharing each sequence inside attention")
    cp_impl: str = opt(
        "ring",
        "context parallelism: ulysses (all-to-all, heads/tp must divide by cp), ring (any heads; "
        "zigzag causal split), hybrid (Ulysses over cp_ulysses ranks, ring across)",
        ("ulysses", "ring", "hybrid"),
    )
    cp_ulysses: int = opt(1, "Ulysses degree inside each ring step (cp_impl=hybrid); must divide cp")
    tp_overlap: bool = opt(
        False,
        "hide the sequence-parallel all-gather / reduce-scatter behind the column / row-parallel "
        "matmuls, chunk by chunk (needs sequence_parallel; exact)",
    )
    tp_overlap_chunks: int = opt(0, "chunks per rank's sequence block for tp_overlap (0 = cost model)")
    ep: int = opt(
        1,
        "expert-parallel degree: each MoE layer's routed experts split over ep ranks carved from "
        "dp × cp (other weights stay replicated; expert gradients are reduced, and ZeRO-sharded, "
        "over the dp × cp / ep ranks holding the same experts); must divide dp × cp and n_experts; "
        "with tp > 1 see parallel.etp and moe.tp_extend_ep",
    )
    etp: int = opt(
        0,
        "expert tensor parallelism with tp > 1: tp = each expert's w1/w3 column- and w2 row-split over "
        "tp (Megatron's expert_tensor_parallel_size); 1 = whole experts on every tp rank, which split "
        "the tokens instead (expert gradients reduced over tp too); 0 = tp",
    )


@dataclass
class TrainSection:
    steps: int = opt(300, "optimizer steps")
    seed: int = opt(0, "seed for initialisation and data order (layout independent)")
    dtype: str = opt(
        "float32", "parameter/compute dtype; bfloat16 keeps fp32 master weights", ("float32", "bfloat16")
    )
    global_batch_size: int = opt(16, "sequences per optimizer step, whatever the layout")
    micro_batch_size: int = opt(4, "sequences per forward/backward on one rank")
    seq_len: int = opt(128, "tokens per sequence")
    lr: float = opt(3e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = opt(20, "linear warmup steps")
    weight_decay: float = opt(0.1, "decoupled AdamW weight decay")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 = off)")
    eval_interval: int = opt(50, "steps between validation-loss measurements (0 = only at the end)")
    eval_batches: int = opt(4, "validation batches (of global_batch_size sequences) per measurement")
    exit_interval: int = opt(
        0,
        "save a checkpoint and exit when the step is a multiple of this, before "
        "train.steps (0 = never); resume later with --checkpoint.resume latest",
    )
    max_bad_steps: int = opt(
        5,
        "a step whose loss or gradient norm is not finite is skipped (no update, "
        "counted in metrics.jsonl); this many in a row stop the run with an error",
    )
    fused_kernels: bool = opt(
        False,
        "time each kernel site once at start-up (RMSNorm, the residual add + RMSNorm, SwiGLU, RoPE on "
        "q and k, the output projection + cross-entropy) and keep, per shape, the fastest of the "
        "reference and its fused versions (Triton on CUDA, torch paths anywhere): never slower "
        "than off; the choices are printed",
    )
    compile: bool = opt(
        False,
        "each transformer block and the loss through torch.compile (inductor); collectives, "
        "context-parallel and swapped attention cores run eagerly between compiled pieces",
    )
    objective: str = opt(
        "lm",
        "what the step minimises: lm (next-token loss on every token: pretraining), sft (next-token "
        "loss on the assistant turns of conversations, per token over the global batch), dpo "
        "(direct preference optimisation on chosen/rejected pairs against the frozen starting "
        "weights; --dpo.*), flow (rectified flow on images: family dit; --flow.*); see "
        "docs/post-training.md and docs/diffusion.md",
        ("lm", "sft", "dpo", "flow"),
    )
    peak_tflops: float = opt(
        0.0,
        "peak TFLOP/s of one device for MFU (0 = table of known GPUs; on CPU or an unlisted GPU "
        "MFU is reported as n/a)",
    )


@dataclass
class DataSection:
    path: str = opt("", "text file/dir or token file; empty = the Python standard library's sources")
    format: str = opt("text", "how to read data.path", ("text", "uint16", "uint32"))
    max_mb: float = opt(8.0, "cap on the embedded corpus size (MB), to keep its first build quick")
    tokenizer: str = opt(
        "bytes",
        "'bytes' (token = byte, vocabulary 256) or a Hugging Face tokenizer: a "
        "directory holding tokenizer.json, or the file; its vocabulary must fit the "
        "model's",
    )
    packing: bool = opt(
        False,
        "per-document attention in each sequence: a token after the tokenizer's end-of-text "
        "separator starts a new document (attention does not cross it, positions restart)",
    )


@dataclass
class RunSection:
    dir: str = opt("runs/tiny", "where metrics.jsonl, plots and checkpoints go")
    device: str = opt(
        "auto",
        "where the workers run: auto (CUDA with nccl when every local rank gets a GPU of its own, "
        "else the CPU with gloo and one line saying what to type to use the GPUs), cpu, or cuda "
        "(refused before any worker starts when the GPUs are fewer than the local ranks)",
        choices=("auto", "cpu", "cuda"),
    )
    log_interval: int = opt(10, "steps between progress lines when the output is not a terminal")
    timeout: float = opt(
        0.0,
        "seconds any collective on any group may wait before the run fails naming the "
        "missing ranks (0 = $MESHSPEED_TIMEOUT, else 300)",
    )
    overwrite: bool = opt(
        False,
        "start fresh in a run.dir that already holds checkpoints or metrics, "
        "deleting them (without it such a run.dir is refused unless resuming); "
        "after a torchrun restart it resumes instead: a restart never deletes "
        "progress",
    )


@dataclass
class CheckpointSection:
    interval: int = opt(0, "steps between checkpoints (0 = only at the end of training)")
    resume: str = opt(
        "",
        "resume from 'latest' (the newest checkpoint in run.dir that verifies; an "
        "error if none), 'auto' (the same, or a fresh start when run.dir has none: for "
        "restarts) or a checkpoint directory (an error if it does not verify)",
    )
    keep: int = opt(3, "checkpoints to keep (older ones are deleted)")
    allow_data_change: bool = opt(
        False,
        "resume even when data.path/format/tokenizer/max_mb differ from what the checkpoint "
        "was trained on (refused otherwise: other tokens under the same step counter)",
    )
    export_safetensors: bool = opt(False, "also export the final model to model.safetensors")
    export_hf: bool = opt(
        False,
        "also export the final model as a Hugging Face directory run.dir/hf "
        "(config.json, safetensors shards + index, the tokenizer's files) that "
        "from_pretrained loads",
    )


@dataclass
class SparsitySection:
    pattern: str = opt(
        "none", "sparse training: 'none' (dense), '2:4', 'unstructured' or any 'N:M' (1:4, 4:8...)"
    )
    target: float = opt(
        0.0, "global sparsity at the end of the ramp (0 = the pattern's: 1 - N/M, or 0.9 unstructured)"
    )
    schedule: str = opt(
        "constant", "how the global target evolves after warmup", ("constant", "cosine", "cubic")
    )
    update_interval: int = opt(100, "steps between mask updates (RigL's delta T)")
    method: str = opt(
        "magnitude",
        "mask update: re-pick top |W|; RigL/SET drop-and-grow (unstructured only); "
        "SR-STE decay of pruned weights",
        ("magnitude", "rigl", "set", "sr-ste"),
    )
    layers: str = opt(
        "layers.*.w?",
        "weights to sparsify: comma-separated globs over linear-module / expert-weight "
        "names, or 're:<regex>' (default: attention, MLP and expert projections)",
    )
    warmup_steps: int = opt(0, "steps trained dense before masks apply")
    ramp_steps: int = opt(0, "length of the cosine/cubic ramp (0 = half of train.steps)")
    initial: float = opt(0.0, "sparsity where the cosine/cubic ramp starts")
    dense_finish_steps: int = opt(0, "last steps of training run dense again")
    distribution: str = opt("uniform", "per-layer unstructured sparsity before adapters", ("uniform", "erk"))
    adapter: str = opt(
        "none",
        "per-layer adapter moving sparsity between layers within the global budget",
        ("none", "magnitude", "gradient", "sensitivity"),
    )
    drop_fraction: float = opt(
        0.3, "RigL/SET: fraction of active weights dropped and regrown per update (cosine-annealed)"
    )
    sr_ste_lambda: float = opt(-1.0, "SR-STE decay of pruned weights (< 0 = 2e-4 for method sr-ste, else 0)")
    transposable: bool = opt(
        True, "2:4 masks that are 2:4 along both dims (sparse input-gradient matmul too)"
    )
    async_masks: bool = opt(
        False,
        "compute each mask update in the background from a snapshot of the update step's weights "
        "and apply it one step later (same masks, same losses whatever the layout or timing)",
    )
    pattern_schedule: str = opt(
        "",
        "elastic N:M: 'step:N:M,...' (e.g. '0:1:4,200:2:4'), the first at step 0 equal to "
        "sparsity.pattern; masks are re-derived at each change ('' = the pattern stays)",
    )
    sparse_grad_comm: bool = opt(
        False,
        "data-parallel gradient reduction sends only the kept values of masked weights between mask "
        "updates (masked positions then get no gradient); dense at update steps",
    )
    kernels: str = opt(
        "auto",
        "2:4 on CUDA (cuSPARSELt): which of y = x W^T and dX = dY W run on sparse tensor cores: auto "
        "(each timed once per shape at start-up against dense-masked, the faster kept), sparse, dense",
        ("auto", "sparse", "dense"),
    )


@dataclass
class MemorySection:
    recompute: str = opt(
        "none",
        "recompute in backward instead of keeping (exact): activation (the SwiGLU product), "
        "selective (+ the attention core), full (whole blocks keep only their input)",
        ("none", "activation", "selective", "full"),
    )
    recompute_layers: int = opt(0, "recompute only the first N blocks of each pipeline stage (0 = all)")
    chunked_loss: bool = opt(
        False,
        "output projection + (vocab-parallel) cross-entropy in chunks of memory.loss_chunk positions "
        "under a checkpoint: the full [batch, seq, vocab/tp] logits never exist (exact up to summation "
        "order; with sequence parallelism each rank's block is cut, with pp the last stage's)",
    )
    loss_chunk: int = opt(256, "sequence positions per chunk of memory.chunked_loss")
    reuse_fp32_param: bool = opt(
        False,
        "bf16 training: keep each fp32 master weight as the bf16 parameter itself plus a 16-bit "
        "residual in the same storage, 2 bytes less per master weight (exact; ZeRO 0/1/2)",
    )
    offload_optimizer: bool = opt(
        False,
        "keep the optimizer state (fp32 masters, AdamW moments) in host memory; each bucket's comes "
        "to the device for its update only, copies overlapped with the neighbouring buckets' (exact)",
    )
    swap_activations: bool = opt(
        False,
        "move what the attention cores save for backward (q, k, v, the softmax statistics) to host "
        "memory in forward and prefetch it back one layer ahead in backward (exact; recompute none "
        "or activation)",
    )
    swap_layers: int = opt(
        0, "swap the attention activations of the first N blocks of each pipeline stage (0 = all)"
    )


@dataclass
class MoeSection:
    dispatcher: str = opt(
        "alltoall",
        "how tokens reach their experts under ep: alltoall (counts exchanged, uneven splits) or "
        "allgather (every member gathers all tokens, partial outputs reduce-scattered; small ep)",
        ("alltoall", "allgather"),
    )
    capacity_factor: float = opt(
        0.0,
        "tokens an expert takes per micro-batch, as a multiple of its fair share "
        "(tokens × top_k / n_experts); overflow slots are dropped in token order and pass through "
        "the residual only (0 = dropless)",
    )
    balance: str = opt(
        "aux",
        "load balancing: aux (the auxiliary loss), bias (DeepSeek-V3's loss-free balancing: a "
        "per-expert routing bias moved after each step towards under-loaded experts; the aux loss "
        "is then off unless moe.aux_loss_coef is set) or none (neither)",
        ("aux", "bias", "none"),
    )
    bias_update_rate: float = opt(1e-3, "balance=bias: how far each step moves an expert's routing bias")
    aux_loss_coef: float = opt(
        -1.0,
        "weight of the load-balancing loss n_experts · Σ_e f_e·P_e (Switch; = 1 when balanced; "
        "Hugging Face's Mixtral loss is top_k times it); < 0 = the preset's",
    )
    z_loss_coef: float = opt(-1.0, "weight of the router z-loss mean(logsumexp(logits)²); < 0 = the preset's")
    tp_extend_ep: bool = opt(
        False,
        "with tp > 1: use the tp ranks as extra expert-parallel ranks (ep × tp of them hold the "
        "experts, whole; the tp ranks split the tokens) instead of splitting each expert over tp "
        "(MindSpeed's choice: no tiny per-expert matmuls); n_experts must divide by ep × tp",
    )
    overlap_shared: bool = opt(
        True,
        "under ep with the alltoall dispatcher, compute the shared experts while the dispatch "
        "all-to-all is in flight (and their backward while its reverse is); same numbers either way",
    )
    replicate_hot: int = opt(
        0,
        "hot experts brought to the data: each MoE layer, each forward, copies the weights of "
        "experts among the K most loaded onto ep ranks routing many tokens to them, while that "
        "unloads the busiest rank; those tokens are computed there and the gradients go back to "
        "the owner before the optimizer step (same numbers; needs ep >= 2, tp = 1, dropless "
        "alltoall; 0 = off)",
    )


@dataclass
class DpoSection:
    beta: float = opt(0.1, "strength of the KL anchor to the reference: the rewards are beta × log-ratio")
    loss: str = opt(
        "sigmoid",
        "sigmoid (the DPO paper), ipo (squared distance of the per-token margin from 1/(2 beta)), "
        "hinge (max(0, 1 - beta × margin), SLiC), or robust (sigmoid corrected for dpo.label_smoothing "
        "flipped labels, rDPO); each as TRL 1.x computes it",
        ("sigmoid", "ipo", "hinge", "robust"),
    )
    label_smoothing: float = opt(
        0.0, "dpo.loss=robust: the assumed fraction of flipped preference labels, 0 ≤ it < 0.5"
    )
    sft_weight: float = opt(0.0, "weight of an SFT term: the chosen answers' per-token NLL (TRL's rpo_alpha)")
    precompute_reference: bool = opt(
        False,
        "compute the reference log-probabilities of every pair once before training (in the run's "
        "layout) and free the reference model, instead of a forward of it every step",
    )


@dataclass
class FlowSection:
    """Rectified flow (train.objective=flow, family dit): docs/diffusion.md."""

    t_sampling: str = opt(
        "logit_normal", "how t is drawn per sample (SD3: logit_normal)", ("uniform", "logit_normal")
    )
    t_mean: float = opt(0.0, "logit_normal: mean of the normal before the sigmoid")
    t_std: float = opt(1.0, "logit_normal: its standard deviation (> 0)")
    label_dropout: float = opt(
        0.1, "probability a label is dropped to the null class (classifier-free guidance)"
    )
    ema_decay: float = opt(
        0.0, "EMA of the weights after each step (e.g. 0.999; 0 = off), saved, used by sample"
    )
    sample_n: int = opt(10, "end of run: images per class sampled and scored beside loss.png (0 = none)")
    sample_steps: int = opt(32, "end of run: Euler steps from noise to image")
    sample_guidance: float = opt(2.0, "end of run: classifier-free guidance scale (1 = none)")


@dataclass
class ModulesSection:
    """Per-module layouts (vlm: the image encoder; the decoder takes parallel.*), also spelled
    `--modules.encoder.ranks 0-1` (Megatron's encoder-*, MindSpeed dist-train): plan/modules.py."""

    encoder_ranks: str = opt(
        "", "ranks running only the encoder, e.g. '0-1' (disaggregated); empty = every rank (colocated)"
    )
    encoder_dp: int = opt(0, "the encoder's own dp (e.g. 4 beside decoder tp 2 × dp 2); 0 = its ranks / tp")
    encoder_tp: int = opt(1, "the encoder's own tensor-parallel degree (its heads and MLP split)")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    sparsity: SparsitySection = field(default_factory=SparsitySection)
    memory: MemorySection = field(default_factory=MemorySection)
    moe: MoeSection = field(default_factory=MoeSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    flow: FlowSection = field(default_factory=FlowSection)
    modules: ModulesSection = field(default_factory=ModulesSection)
    nproc: int = opt(4, "local worker processes to spawn when not launched by torchrun")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
