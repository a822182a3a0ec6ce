"""`meshspeed run`: any Python script on N local workers, under meshspeed's launcher.

Each worker runs the script as `__main__` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), so a script
that calls `torch.distributed.init_process_group()` or `meshspeed.comm.init()` runs unchanged.
The launcher is the one `meshspeed train` uses: the first failure is named with its rank and
cause, every other worker is stopped, and no worker outlives the launcher.
"""

from __future__ import annotations

import argparse
import ast
import os
import runpy
import sys

# Libraries the launcher may import for the workers it forks (never the script, never a module
# next to it: nothing of the user's is executed in the launcher). Each costs seconds of CPU per
# worker when every worker imports it fresh: torch ~3 s, transformers ~6 s more on 2 cores.
PRELOADABLE = ("torch", "numpy", "transformers", "meshspeed")
START_METHODS = ("auto", "spawn")

EXAMPLES = """examples:
  meshspeed run --nproc 2 train.py                        # 2 workers, each runs train.py as __main__
  meshspeed run --nproc 4 train.py --lr 3e-4 --steps 100  # everything after the script is its own
  meshspeed run --nproc 2 --max-restarts 3 train.py       # a failed group starts again, 3 times at most

The script reads its place in the job from the environment, as under torchrun:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (127.0.0.1 and a free
port), OMP_NUM_THREADS (the cores split between workers) and TORCHELASTIC_RESTART_COUNT (0, then
1, 2, ... after each restart: resume from your checkpoint when it is not 0).

When things go wrong: a worker that raises ends the job and the last line names it,
"meshspeed: rank 1 failed: ValueError: ... (the other worker was stopped)", with the traceback
above; a worker killed by a signal is named with it ("rank 1 was killed by SIGKILL (exit -9)");
Ctrl-C or SIGTERM to this command stops every worker. sys.exit(0) in a worker is success.
Collectives time out where the script asks: meshspeed.comm.init() applies MESHSPEED_TIMEOUT
(default 300 s) to every group; a plain init_process_group() has torch's default unless the
script passes timeout=. Exit codes: 0 success, 1 a worker failed (after the last restart), 2 a bad
argument (one line, before any worker starts), 128 + N stopped by signal N. See docs/run.md.

Limits: --nproc at most 8 workers per core and one per 256 MiB of available memory
(MESHSPEED_MAX_WORKERS=N raises it). When the job ends, whatever a worker started (each worker
leads its own process group) is stopped with it; a rank still running 30 s after the others
finished is named, and the job keeps waiting for it.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run any Python script on N local workers (torchrun's environment, meshspeed's launcher)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Strings, checked in `run`: a bad value is one line there, not argparse's usage block.
    p.add_argument(
        "--nproc", metavar="N", default="1", help="worker processes to start (default 1, as torchrun)"
    )
    p.add_argument(
        "--max-restarts",
        metavar="K",
        default="0",
        help="when a worker fails, stop the group and start all workers again, at most K times "
        "(default 0, as torchrun); TORCHELASTIC_RESTART_COUNT tells the script which attempt it is",
    )
    p.add_argument(
        "--start-method",
        metavar="M",
        default="auto",
        help="auto (default): on a machine without a GPU, the workers are forked from the launcher "
        "after it imports the well-known libraries the script imports at its top level (torch, "
        "transformers, numpy, meshspeed), so each worker skips those imports; with a GPU, or if the "
        "launcher is not single-threaded then, fresh interpreters. spawn: always fresh interpreters",
    )
    p.add_argument(
        "script", nargs="?", metavar="script.py", help="the Python file each worker runs as __main__"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (its sys.argv[1:])")
    p.set_defaults(func=run)


def _count(name: str, raw: str, least: int, example: str) -> int:
    from meshspeed.comm import ConfigError

    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"{name}={raw} must be a whole number ≥ {least}; e.g. {name} {example}")
    return value


def _check_script(path: str | None) -> str:
    from meshspeed.comm import ConfigError

    if not path:
        raise ConfigError("no script given; name a Python file: meshspeed run --nproc 2 train.py [args...]")
    if not os.path.exists(path):
        raise ConfigError(f"script={path} does not exist (from {os.getcwd()}); give the path of a .py file")
    if not os.path.isfile(path):
        raise ConfigError(f"script={path} is not a file; give the .py file to run, e.g. {path}/train.py")
    if not path.endswith(".py"):
        raise ConfigError(f"script={path} is not a Python file (.py); meshspeed run runs Python scripts")
    return path


def _start(method: str) -> str:
    from meshspeed.comm import ConfigError

    if method not in START_METHODS:
        raise ConfigError(f"--start-method={method} is not known; valid: {', '.join(START_METHODS)}")
    return method


def preloadable(path: str) -> dict[str, set[str]]:
    """The PRELOADABLE libraries `path` imports at its top level, each with the names the script
    takes from it (`from transformers import X`, `transformers.X`): read with `ast`, the file is
    parsed, never run. A file that does not parse preloads nothing: its worker's error says why."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (SyntaxError, ValueError, OSError):
        return {}
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                found.setdefault(a.name.split(".")[0], set())
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.setdefault(node.module.split(".")[0], set()).update(a.name for a in node.names)
    for node in ast.walk(tree):  # lazy packages (transformers) import a class when it is named
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in found:
            found[node.value.id].add(node.attr)
    return {n: found[n] for n in PRELOADABLE if n in found}


def preload(libraries: dict[str, set[str]]) -> None:
    """Import each library and touch the names the script takes from it, so that a lazy package's
    modules (transformers.LlamaForCausalLM) are loaded once here rather than in every worker. A
    library that does not import, or a name that is missing, is left for the worker to fail on,
    with its own message and traceback."""
    import importlib

    for name, attrs in libraries.items():
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by the worker that imports it
            continue
        for attr in sorted(attrs):
            try:
                getattr(module, attr)
            except Exception:  # noqa: BLE001 - the worker reports it where the script asks for it
                pass


def fork_allowed(method: str) -> bool:
    """Whether the workers may be forked: `auto` on a machine where torch sees no GPU (a CUDA
    context must never be inherited; counting devices creates none). launch.start_method still
    falls back to fresh interpreters if the launcher is not single-threaded after preloading."""
    if method != "auto":
        return False
    from meshspeed.comm.context import local_gpus

    return local_gpus() == 0


class ScriptExit(Exception):
    """sys.exit(code) in a worker, code not 0: reported like an error, in one line."""

    one_line = True


def script_worker(path: str, argv: list[str]) -> None:
    """One rank: the script as `python path argv...` would run it (module-level: spawn pickles it)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as python does for a script
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as err:
        if err.code in (None, 0):
            return
        # Without this the launcher could only say "exited with code 1 without reporting an
        # error"; sys.exit("message") is the script's own one-line report.
        what = err.code if isinstance(err.code, str) else f"the script called sys.exit({err.code!r})"
        raise ScriptExit(what) from None


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch

    try:
        nproc = _count("--nproc", args.nproc, 1, "2")
        launch.check_workers(nproc)  # before anything starts: 1,000 forks would exhaust memory
        restarts = _count("--max-restarts", args.max_restarts, 0, "3")
        script = _check_script(args.script)
        method = _start(args.start_method)
    except ConfigError as err:
        print(f"meshspeed run: {err}", file=sys.stderr)
        return 2
    fork_ok = fork_allowed(method)
    if fork_ok:
        preload(preloadable(script))
    code = 0
    for attempt in range(restarts + 1):
        if attempt:
            print(
                f"meshspeed run: restart {attempt} of {restarts}: starting all {nproc} workers again "
                f"(TORCHELASTIC_RESTART_COUNT={attempt})",
                file=sys.stderr,
                flush=True,
            )
        # Each attempt is a fresh spawn: a new port, so a new store with nothing of the dead attempt.
        env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(restarts)}
        # forked workers start from the launcher's imports; each attempt forks afresh from it (the
        # launcher never runs the script, so a restart starts from the same clean state)
        code = launch.spawn(script_worker, nproc, (script, list(args.args)), env=env, fork_ok=fork_ok)
        # 0: done; 128 + signal: the launcher itself was stopped (Ctrl-C, SIGTERM), which is not
        # a worker's failure to retry.
        if code == 0 or code >= 128:
            return code
    return code
