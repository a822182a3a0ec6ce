"""The machine a layout is planned for: peak throughput, memory, links, as plain data.

A prediction is only as good as these numbers, so every one can be given on the command line,
taken from a named device (the vendors' dense bf16 peaks and link bandwidths), or measured on
this machine by `meshspeed plan --calibrate` (a matmul for the compute rate, `bench comm`'s fit
for the links) and stored beside the link parameters `bench comm` saves.

The achievable fractions are what separates a peak from a step: large bf16 matmuls reach about
70% of the dense peak on Hopper (cuBLAS), attention kernels about half; the tile terms charge
small matrices (a short micro-batch, a wide tp split) for the occupancy they lose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

from meshspeed.comm.cost_model import LinkParams
from meshspeed.comm.errors import ConfigError


@dataclass
class Machine:
    name: str
    peak_tflops: float  # dense, in the training dtype, per device
    memory_gib: float  # device memory
    mem_bw_gbs: float  # device memory bandwidth (GB/s): the optimizer step's cost
    intra_gbs: float  # link bandwidth between devices of one node (GB/s, per direction)
    inter_gbs: float  # link bandwidth between nodes (GB/s per device)
    gpus_per_node: int
    alpha_us: float = 10.0  # per-message latency
    backend: str = "nccl"
    matmul_eff: float = 0.70  # achievable fraction of peak for large matmuls
    attn_eff: float = 0.50  # ... for the attention core
    tile: float = 128.0  # rows/columns at which a matmul runs at half its large-size rate
    shared_cores: int = 0  # CPU ranks share this many cores (0: each rank owns its device)
    # What one blocking collective between two bursts of compute costs beyond the α-β formula,
    # per group size ("2": µs, ...): on CPU ranks sharing cores, the wait for peers the
    # scheduler has not run yet, which grows with the group (a tensor-parallel step is hundreds
    # of them). Measured by `plan --calibrate`; none on devices.
    sync_us: dict = dataclasses.field(default_factory=dict)

    def sync_s(self, group: int) -> float:
        """Seconds of that wait for a group of `group` ranks: the largest measured group not
        above it (the smallest measured one below all of them)."""
        sizes = sorted(int(k) for k in self.sync_us)
        if group < 2 or not sizes:
            return 0.0
        below = [k for k in sizes if k <= group]
        return self.sync_us[str(below[-1] if below else sizes[0])] * 1e-6

    def rank_peak(self, world: int) -> float:
        """FLOP/s one rank gets: the device's, or its share of the cores ranks run on together."""
        share = min(1.0, self.shared_cores / world) if self.shared_cores else 1.0
        return self.peak_tflops * 1e12 * share

    def links(self) -> LinkParams:
        """The cost model's α-β parameters for these links (γ: reductions at memory speed)."""
        a, gamma = self.alpha_us * 1e-6, 1 / (self.mem_bw_gbs * 1e9)
        intra, inter = 1 / (self.intra_gbs * 1e9), 1 / (self.inter_gbs * 1e9)
        vals = {
            "native.intra": (a, intra, gamma),
            "native.inter": (2 * a, inter, gamma),
            "p2p.intra": (a, intra, gamma),
            "p2p.inter": (2 * a, inter, gamma),
        }
        return LinkParams(vals, f"machine {self.name}")


# Dense bf16 peaks (vendor data sheets, SXM parts); NVLink per direction; one 400 Gb/s NIC per GPU.
MACHINES = {
    "h100": Machine("h100", 989.0, 80, 3350, 450, 50, 8),
    "h200": Machine("h200", 989.0, 141, 4800, 450, 50, 8),
    "a100": Machine("a100", 312.0, 80, 2039, 300, 25, 8),
    "b200": Machine("b200", 2250.0, 192, 8000, 900, 50, 8),
    # a laptop-class CPU under gloo: ranks are processes sharing the cores; `--calibrate` replaces it
    "cpu": Machine(
        "cpu",
        0.1,
        16,
        20,
        2.5,
        1.0,
        4,
        alpha_us=60,
        backend="gloo",
        matmul_eff=0.5,
        attn_eff=0.3,
        tile=16,
        shared_cores=os.cpu_count() or 1,
    ),
}


def calibration_path() -> str:
    return os.environ.get("MESHSPEED_MACHINE") or os.path.join(
        os.path.expanduser("~"), ".cache", "meshspeed", "machine.json"
    )


def get_machine(name: str, **overrides) -> Machine:
    """A named machine, or 'calibrated' (what `--calibrate` stored), with explicit overrides."""
    if name == "calibrated":
        path = calibration_path()
        try:
            with open(path) as f:
                base = Machine(**json.load(f))
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(
                f"--device calibrated: no usable calibration at {path} ({err}); run "
                "`meshspeed plan --calibrate` first, or name a device: " + ", ".join(MACHINES)
            ) from None
    elif name in MACHINES:
        base = MACHINES[name]
    else:
        raise ConfigError(f"--device {name!r} is not known; use one of {', '.join(MACHINES)}, calibrated")
    given = {k: v for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        if k != "gpus_per_node" and not v > 0:
            raise ConfigError(f"--{k.replace('_', '-')} {v} must be > 0")
    return dataclasses.replace(base, **given)


def measure_matmul_tflops(n: int = 1024, dtype=None, seconds: float = 1.0) -> float:
    """This process's sustained matmul rate (TFLOP/s) on an n×n×n product: the compute unit the
    CPU predictions are made in."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def _sync_worker(flops: float, reps: int, out: str, group_size: int = 0) -> None:
    import torch

    from meshspeed import comm

    ctx = comm.init("gloo")
    torch.set_num_threads(1)
    g = group_size or ctx.world_size
    group = ctx.world
    if g < ctx.world_size:  # groups of g side by side, as tp's groups are
        group = comm.ParallelDims(dp=ctx.world_size // g, tp=g).build(ctx)["tp"]
    n = max(16, round((flops / 2) ** (1 / 3)))
    a, tok = torch.randn(n, n), torch.zeros(256)

    def run(blocking: bool) -> float:
        comm.barrier(ctx.world)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a)
            if blocking:
                comm.all_reduce(tok, group)
        comm.barrier(ctx.world)
        return time.perf_counter() - t0

    run(True)  # warm-up
    plain, synced = [], []
    for _ in range(3):  # interleaved, so a change of load hits both alike
        plain.append(run(False))
        synced.append(run(True))
    extra = torch.tensor([(min(synced) - min(plain)) / reps])
    comm.all_reduce(extra, ctx.world, "max")
    if ctx.rank == 0:
        with open(out, "w") as f:
            f.write(str(max(float(extra), 0.0)))
    ctx.close()


def measure_sync_us(
    world: int, tflops: float, compute_us: float = 500.0, reps: int = 60, group_size: int = 0
) -> float:
    """Microseconds one blocking 1 KiB all-reduce adds between bursts of `compute_us` of
    matmul, on `world` gloo ranks of this machine running at once: the cost of tensor
    parallelism's pattern that burst benchmarks (bench comm) hide, dominated on CPU ranks that
    share cores by waiting for a peer the scheduler has not run yet."""
    import tempfile

    from meshspeed.comm import launch

    flops = tflops * 1e12 * compute_us * 1e-6 * min(1.0, (os.cpu_count() or 1) / world)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sync")
        code = launch.spawn(_sync_worker, world, (flops, reps, out, group_size))
        if code or not os.path.exists(out):
            raise ConfigError(f"plan --calibrate: the {world} ranks timing a blocking collective failed")
        with open(out) as f:
            return float(f.read()) * 1e6


def save_calibration(machine: Machine) -> str:
    path = calibration_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(machine), f, indent=1)
    os.replace(tmp, path)
    return path
