"""CommContext: one per process, created by `init()`; it owns everything comm-wide.

The context holds what would otherwise be module-level globals: the rendezvous store, the
flight recorder, the node topology, the cost model's link parameters and the groups made so
far. It is passed down explicitly (through Groups and the ParallelDims mesh).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import meshspeed.comm.cost_model as cost_model
import meshspeed.comm.desync as desync
import meshspeed.comm.gloo_transport as gloo_transport
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group
from meshspeed.comm.trace import FlightRecorder

DEFAULT_TIMEOUT_S = 300.0
# Joining the job waits for the slowest worker to start (importing torch on a loaded machine
# takes seconds), which has nothing to do with how long a collective may take: a short
# MESHSPEED_TIMEOUT must not fail the start-up.
START_TIMEOUT_S = 300.0
# Leaving the job: rank 0 may still be writing its plot or export while the others wait.
CLOSE_TIMEOUT_S = 120.0


DEVICES = ("auto", "cpu", "cuda")


def local_gpus() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 without CUDA. Counting
    creates no CUDA context, so a launcher that counts before it spawns leaves the GPUs whole to
    its workers."""
    return torch.cuda.device_count()


@dataclass(frozen=True)
class DeviceChoice:
    """Where the ranks of one node run, decided before any of them starts."""

    device: str  # "cpu" | "cuda" (local rank r on cuda:r)
    backend: str  # "gloo" | "nccl"
    local_ranks: int
    local_gpus: int
    why: str  # a phrase for --dry-run
    notice: str = ""  # auto chose the CPU although GPUs are there: the one line saying what to type


def choose_device(
    requested: str, local_ranks: int, gpus: int, *, key: str = "run.device", fix: str = ""
) -> DeviceChoice:
    """`requested` (auto | cpu | cuda) for `local_ranks` ranks on a node with `gpus` GPUs.

    auto takes CUDA only when every local rank gets a GPU of its own: ranks sharing a device
    under NCCL fail ("invalid device ordinal", or NCCL refusing two ranks on one GPU). Fewer
    GPUs than ranks runs the job on the CPU, with a notice naming `fix` (what to type to use
    the GPUs: "add --nproc 1"); cuda with fewer GPUs is one ConfigError line naming both numbers."""
    if requested not in DEVICES:
        raise ConfigError(f"{key}={requested!r} is not valid; choose one of {', '.join(DEVICES)}")
    have = f"{gpus} GPU{'s' if gpus != 1 else ''}"
    if requested == "cpu":
        return DeviceChoice("cpu", "gloo", local_ranks, gpus, f"{key}=cpu")
    if 0 < local_ranks <= gpus:
        why = f"one GPU per local rank ({local_ranks} of {have})"
        return DeviceChoice("cuda", "nccl", local_ranks, gpus, why)
    fix = fix or f"run {gpus} local rank{'s' if gpus != 1 else ''}"
    if requested == "cuda":
        seen = f"{have} visible" if gpus else "no GPU visible (torch.cuda.device_count() is 0)"
        alt = f"{fix}, or set {key} cpu" if gpus else f"set {key} cpu or auto"
        raise ConfigError(f"{key}=cuda needs a GPU per local rank: {local_ranks} local ranks, {seen}; {alt}")
    if gpus == 0:
        return DeviceChoice("cpu", "gloo", local_ranks, gpus, "no GPU visible")
    return DeviceChoice(
        "cpu",
        "gloo",
        local_ranks,
        gpus,
        f"{local_ranks} local ranks, {have}: too few to give each rank its own",
        f"{key}=auto: {local_ranks} local ranks but {have}, so this job runs on the CPU (gloo); "
        f"to use the GPU{'s' if gpus != 1 else ''}, {fix}",
    )


def fit_degrees(gpus: int, degrees: dict[str, int]) -> dict[str, int]:
    """`degrees` (in order of preference) kept while their product divides `gpus`, the others 1:
    a layout to suggest for the GPUs a node has."""
    out, product = {}, 1
    for name, d in degrees.items():
        keep = d > 1 and gpus % (product * d) == 0
        out[name] = d if keep else 1
        product *= out[name]
    return out


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; e.g. {name}=60") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be > 0 seconds; e.g. {name}=60")
    return value


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _compact(ranks: list[int]) -> str:
    """`0-3`, `0-6/2` for arithmetic progressions, else a comma list: short, unique, readable."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" + (f"/{step}" if step != 1 else "")
    return ",".join(map(str, ranks))


_ANNOUNCED: set = set()


def _announced(params: cost_model.LinkParams) -> cost_model.LinkParams:
    """Say once per process (rank 0) that saved link parameters choose the algorithms, or why
    a saved file was ignored: a run that behaves differently because of a file a benchmark
    wrote earlier must say so."""
    if params.path:
        m = params.machine
        line = (
            f"meshspeed: collective algorithms chosen from {params.path} ({params.source}; host "
            f"{m.get('host')}, {m.get('cpus')} cpus, torch {m.get('torch')}); MESHSPEED_LINK_PARAMS=none "
            "uses the built-in defaults"
        )
    else:
        line = f"meshspeed: {params.note}" if params.note else ""
    if line and line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, file=sys.stderr, flush=True)
    return params


class CommContext:
    """Per-process communication state. Use `init()` to make one."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        store,
        timeout_s: float,
        debug: bool,
        ranks_per_node: int,
        device: torch.device,
        backend_timeout_s: float | None = None,
    ):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = store
        self.timeout_s = timeout_s
        self.backend_timeout_s = backend_timeout_s  # the process group's own timeout, if we set it
        self.debug = debug
        self.ranks_per_node = ranks_per_node
        self.device = device
        self.recorder = FlightRecorder(rank, int(os.environ.get("MESHSPEED_TRACE_BUFFER", "2000")))
        self.trace_dir = os.environ.get("MESHSPEED_TRACE_DIR") or None
        self.forced_algos = cost_model.parse_algo_env(os.environ.get("MESHSPEED_ALGO", ""))
        self.link_params = self._shared_link_params()
        self._groups: dict[tuple, Group] = {}
        # Keys of groups split off without this rank: torch's new_group must be called by every
        # rank for every group, so a member's cache hit must be one here too, or a repeated
        # split would make a group on some ranks and not on others (and hang).
        self._split_elsewhere: set[tuple] = set()
        self._meshes: dict = {}  # ParallelDims -> Mesh: building twice would double every group
        pg = dist.group.WORLD if world_size > 1 else None
        self.world = Group(self, pg, list(range(world_size)), "world", backend_timeout_s)
        # Every rank's liveness in the store, for the timeout diagnosis to name a stopped rank
        self.heartbeat = desync.Heartbeat(store, rank) if store is not None and world_size > 1 else None
        self._groups[("world", tuple(range(world_size)))] = self.world

    @property
    def plain_wait(self) -> bool:
        """Every group this context makes carries its timeout, so the process group enforces our
        deadline itself (see group.wait_work)."""
        return self.backend_timeout_s is not None and self.timeout_s >= self.backend_timeout_s

    @property
    def group_timeout(self) -> timedelta:
        """The timeout every process group made by this context gets (the backend's own)."""
        return timedelta(seconds=self.backend_timeout_s or self.timeout_s)

    def mesh_for(self, dims, build):
        """The mesh of `dims`, built once per context by `build()`: building twice would double
        every group."""
        if dims not in self._meshes:
            self._meshes[dims] = build()
        return self._meshes[dims]

    # -- topology -------------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        """Launchers place ranks node by node, so a node holds a contiguous block of ranks."""
        return rank // self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    # -- groups ---------------------------------------------------------------------------
    def prefixed_store(self, prefix: str):
        return dist.PrefixStore(prefix, self.store) if self.store is not None else None

    def split(self, partition: list[list[int]], label: str) -> Group:
        """Make one group per rank list in `partition` and return the one holding this rank.

        Collective over the whole world: every rank must call it with the same partition
        (torch's new_group requires it). Groups already made are reused.
        """
        mine = None
        for ranks in partition:
            ranks = [int(r) for r in ranks]
            key = (label, tuple(ranks))
            group = self._groups.get(key)
            if group is None and key not in self._split_elsewhere:
                pg = None
                if len(ranks) > 1:
                    with gloo_transport.shared(self.backend):
                        pg = dist.new_group(ranks, timeout=self.group_timeout)
                if self.rank in ranks:
                    group = Group(
                        self, pg, ranks, f"{label}[{_compact(ranks)}]", self.group_timeout.total_seconds()
                    )
                    self._groups[key] = group
                else:  # made without this rank: a repeat of the split must not make it again
                    self._split_elsewhere.add(key)
            if self.rank in ranks:
                mine = group
        if mine is None:
            raise ConfigError(f"group {label!r}: rank {self.rank} is in none of {partition}")
        return mine

    def adopt(self, pg, ranks: list[int], label: str, backend_timeout_s: float | None = None) -> Group:
        """Wrap a process group made elsewhere (a DeviceMesh's) that holds this rank.
        `backend_timeout_s`: the timeout it was made with, when known."""
        key = (label, tuple(ranks))
        if key not in self._groups:
            name = f"{label}[{_compact(list(ranks))}]"
            self._groups[key] = Group(self, pg, list(ranks), name, backend_timeout_s)
        return self._groups[key]

    def single(self, label: str = "self") -> Group:
        """A group of just this rank (degree-1 parallel dims): every collective is a no-op."""
        key = (label, (self.rank,))
        if key not in self._groups:
            self._groups[key] = Group(self, None, [self.rank], f"{label}[{self.rank}]")
        return self._groups[key]

    # -- tracing --------------------------------------------------------------------------
    def dump_trace(self) -> str | None:
        if not self.trace_dir:
            return None
        try:
            return self.recorder.dump(os.path.join(self.trace_dir, f"flight_rank{self.rank}.json"))
        except OSError:
            return None

    def _shared_link_params(self) -> cost_model.LinkParams:
        """Rank 0 loads the fitted parameters and shares them, so every rank picks the same
        algorithm for the same call (different choices on different ranks would hang)."""
        if self.world_size == 1 or self.store is None:
            return _announced(cost_model.load(self.backend))
        if self.rank == 0:
            params = _announced(cost_model.load(self.backend))
            self.store.set("meshspeed/link_params", json.dumps(params.to_dict()))
        return cost_model.LinkParams.from_dict(json.loads(self.store.get("meshspeed/link_params")))

    def close(self) -> None:
        """Leave the job cleanly, after a run that succeeded on this rank.

        A rank that failed does not call this: it exits at once (see launch.run_worker), since
        waiting here for peers that will never come is exactly the hang to avoid. The ranks
        meet through the store, not a collective, with a generous bound: rank 0 may still be
        writing its plot or export, and a store wait costs nothing while it does. Every
        reference to the process groups is dropped before they are destroyed: a
        ProcessGroupGloo that outlives destroy_process_group is torn down at interpreter exit
        instead, where its threads can abort the process ("terminate called without an active
        exception")."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        self._store_barrier("meshspeed/close", max(self.timeout_s, CLOSE_TIMEOUT_S))
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for group in self._groups.values():
            group.close()  # its worker thread joined, its process group dropped
        self._groups.clear()
        self._split_elsewhere.clear()
        self._meshes.clear()
        self.world.pg = None
        dist.destroy_process_group()

    def _store_barrier(self, key: str, timeout_s: float) -> None:
        """All ranks reach this point (or `timeout_s` passes); nobody tears down connections a
        peer is still using. Best effort: the work is done, so a peer that is already gone is
        not an error here."""
        if self.store is None:
            return
        try:
            if self.store.add(key, 1) == self.world_size:
                self.store.set(f"{key}/done", "1")
            self.store.wait([f"{key}/done"], timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - rank 0 (the store's host) may have left already
            pass


def launched() -> bool:
    """True under torchrun / meshspeed's own spawner (the env names this process's rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _elastic_store(store):
    """torchrun's agent keeps one store for every restart of the workers, so after a restart
    the keys of the dead attempt (gloo's peer addresses, meshspeed's own) are still there and
    the new workers connect to addresses of processes that no longer exist. A prefix per
    attempt gives each restart a clean namespace."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return dist.PrefixStore(f"meshspeed/attempt-{attempt}/", store) if attempt is not None else store


def _start_barrier(store, world_size: int, timeout_s: float) -> None:
    """Wait until every worker has joined, with the start-up bound: after this the ranks are
    within moments of each other, so the backend's connection set-up (bounded by the
    collective timeout, which may be seconds) does not wait on a slow starter."""
    if store.add("meshspeed/started", 1) == world_size:
        store.set("meshspeed/all_started", "1")
    try:
        store.wait(["meshspeed/all_started"], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - DistStoreError / RuntimeError, by torch version
        raise ConfigError(
            f"only some of the {world_size} workers joined the job within {timeout_s:g}s "
            f"(MESHSPEED_START_TIMEOUT); did a worker fail to start?"
        ) from None


def init(
    backend: str | None = None,
    *,
    timeout_s: float | None = None,
    debug: bool | None = None,
    ranks_per_node: int | None = None,
    device: str = "auto",
) -> CommContext:
    """Join the job described by the environment (torchrun's or meshspeed spawn's variables).

    With no launcher and no WORLD_SIZE this is a single process with no process group at all.
    Timeout of every collective on every group: `timeout_s`, else MESHSPEED_TIMEOUT seconds
    (default 300); start-up (waiting for every worker to join): MESHSPEED_START_TIMEOUT
    (default 300, never less than the timeout); debug desync checks: MESHSPEED_DEBUG=1; ranks
    per node: MESHSPEED_RANKS_PER_NODE, else the launcher's LOCAL_WORLD_SIZE.
    device: auto | cpu | cuda (choose_device over this node's LOCAL_WORLD_SIZE ranks; the run plan
    passes the choice it made before spawning). The backend follows it (nccl on CUDA, gloo on
    CPU) unless `backend` or MESHSPEED_BACKEND names one; nccl puts this rank on cuda:LOCAL_RANK.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r} must be > 0 seconds; e.g. 60")
    timeout_s = timeout_s if timeout_s is not None else _env_float("MESHSPEED_TIMEOUT", DEFAULT_TIMEOUT_S)
    start_s = max(timeout_s, _env_float("MESHSPEED_START_TIMEOUT", START_TIMEOUT_S))
    debug = debug if debug is not None else _env_flag("MESHSPEED_DEBUG")
    if not backend and not os.environ.get("MESHSPEED_BACKEND"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched() else 1
        backend = choose_device(device, local, local_gpus(), key="device").backend
    backend = backend or os.environ["MESHSPEED_BACKEND"]
    if backend == "nccl" and not dist.is_initialized():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if launched() else 1
    rank, store, backend_timeout_s = 0, None, None
    if world_size > 1:
        if not dist.is_initialized():
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=start_s)))
            store = _elastic_store(store)
            _start_barrier(store, world_size, start_s)
            # The backend enforces the same timeout as meshspeed, on this group and on every
            # group made later (see CommContext.split and Mesh), so the fast path can wait
            # without one; either way the timeout is diagnosed by meshspeed (names the missing
            # ranks). A context asking for a shorter timeout later waits explicitly.
            with gloo_transport.shared(backend):  # every group meshspeed makes polls one device
                dist.init_process_group(
                    backend, store=store, rank=rank, world_size=world_size,
                    timeout=timedelta(seconds=timeout_s),
                )
            backend_timeout_s = timeout_s
        else:  # someone else initialised torch.distributed; adopt their default group
            rank, world_size = dist.get_rank(), dist.get_world_size()
            store = dist.distributed_c10d._get_default_store()
            backend = dist.get_backend()
    if ranks_per_node is None:
        env = os.environ.get("MESHSPEED_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE")
        ranks_per_node = int(env) if env else world_size
    if ranks_per_node < 1 or world_size % ranks_per_node:
        fit = max(d for d in range(1, world_size + 1) if world_size % d == 0 and d <= max(ranks_per_node, 1))
        raise ConfigError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}; "
            f"use a divisor such as {fit}"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return CommContext(
        rank, world_size, backend, store, timeout_s, debug, ranks_per_node, device, backend_timeout_s
    )
