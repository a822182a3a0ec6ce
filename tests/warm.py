"""`python -m meshspeed ...` for tests, started warm: forked from a server that imported torch.

A launched command pays the interpreter's start and the torch import first: 7-9 s of CPU on the
2-core CI machine, more than most of the tests spend on what they check, and the CI tier
launches dozens. Here the command runs in a process forked from tests/harness.py's fork server
(torch, DTensor, DCP and the trainer already imported), which then does what `python -m` does:
the command's own environment, working directory, argv and standard streams, `meshspeed`'s
`__main__` run as the main module, non-daemon threads joined and exit handlers run at the end,
its exit code (or the signal that ended it) returned. It is a separate process with its own pid
and session, so signals, process-tree checks, locks and files behave as for any command.

What it does not cover is the interpreter's start itself (`__main__`'s environment set before
torch is imported, the import-time behaviour of a cold process): tests of that keep a real
`subprocess` (`run(..., cold=True)`, and torchrun or any other module, which always start
cold). Only `-m meshspeed`, `-m benchmarks.*`, WARM_MODULES and `-c` snippets start warm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from tests import harness

# modules a command line may run warm: the CLI, the benchmarks, the tests' batch of CLI lines
WARM_MODULES = ("meshspeed", "tests.cli_batch", "tests.sleeper")
WARM_PACKAGES = ("benchmarks.",)


def _warm_module(cmd) -> str | None:
    """The module (or "-c") a command line runs warm, None for one that must start cold."""
    cmd = [str(c) for c in cmd]
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-c":
        return "-c"  # a snippet: run as the main module's code, with argv ["-c", *args]
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        mod = cmd[2]
        if mod in WARM_MODULES or mod.startswith(WARM_PACKAGES):
            return mod
    return None


def _fd(spec, mode: int) -> int:
    return os.open(spec, mode, 0o644)


def _path(stream):
    """A file to connect a warm command's stream to: None (nothing), a path or an open file;
    None here for what only a real subprocess can do (PIPE, another process's fd)."""
    if stream is None or stream == subprocess.DEVNULL:
        return os.devnull
    if isinstance(stream, (str, os.PathLike)):
        return os.fspath(stream)
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) and os.path.exists(name) else None


def _child(mod, argv, cwd, env, stdin, stdout, stderr, new_session) -> None:
    """Runs in the forked process: become `python -m mod argv...` and exit as it would."""
    import atexit
    import runpy
    import threading
    import traceback

    if new_session:
        os.setsid()
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for spec, fd, mode in ((stdin, 0, os.O_RDONLY), (stdout, 1, write), (stderr, 2, write)):
        src = _fd(spec, mode)
        os.dup2(src, fd)
        os.close(src)  # the stream lives on as fd 0, 1 or 2 only
    sys.stdin = open(0, closefd=False)  # the process's own streams, open for its life
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if mod == "-c":
            sys.argv = ["-c", *argv[1:]]
            main = sys.modules["__main__"].__dict__
            main.clear()
            main.update(__name__="__main__", __builtins__=__builtins__)
            exec(compile(argv[0], "<string>", "exec"), main)
        else:
            sys.argv = [mod, *argv]
            runpy.run_module(mod, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if isinstance(stop.code, int):
            code = stop.code
        elif stop.code is not None:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter would print, and exit 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as the interpreter does: wait for non-daemon threads, then exit handlers
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Proc:
    """The part of `subprocess.Popen` the tests use, for a warm command."""

    def __init__(
        self, cmd, *, cwd=None, env=None, stdin=None, stdout=None, stderr=None, start_new_session=False
    ):
        self.args = list(cmd)
        mod = _warm_module(cmd)
        assert mod is not None, cmd
        ctx = harness.context()
        env = dict(os.environ if env is None else env)
        self._proc = ctx.Process(
            target=_child,
            args=(
                mod,
                [str(a) for a in cmd[(2 if mod == "-c" else 3):]],
                str(cwd or os.getcwd()),
                env,
                _path(stdin),
                _path(stdout),
                _path(stderr),
                start_new_session,
            ),
            daemon=False,
        )
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None
        if start_new_session:  # as Popen returns: the child already leads its own session
            deadline = time.monotonic() + 30
            while self.poll() is None and time.monotonic() < deadline:
                try:
                    if os.getpgid(self.pid) == self.pid:
                        break
                except ProcessLookupError:
                    break
                time.sleep(0.005)

    def poll(self):
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen(cmd, *, cold: bool = False, **kw):
    """`subprocess.Popen(cmd, **kw)`, warm where the command allows (stdout/stderr: files)."""
    streams = {k: kw[k] for k in ("stdin", "stdout", "stderr") if k in kw}
    if cold or _warm_module(cmd) is None or any(_path(v) is None for v in streams.values()):
        return subprocess.Popen(cmd, **kw)
    return Proc(cmd, **kw)


def run(cmd, *, cwd=None, env=None, timeout=None, input=None, cold: bool = False, check: bool = False, **kw):
    """`subprocess.run(cmd, capture_output=True, text=True, ...)`, warm where the command allows
    (its output is always captured, as text)."""
    kw.pop("capture_output", None)
    kw.pop("text", None)
    if cold or _warm_module(cmd) is None or kw:
        return subprocess.run(
            cmd, cwd=cwd, env=env, timeout=timeout, input=input, capture_output=True, text=True,
            check=check, **kw,
        )
    with tempfile.TemporaryDirectory(prefix="warm-") as d:
        paths = [os.path.join(d, n) for n in ("in", "out", "err")]
        for p, text in zip(paths, (input or "", "", "")):
            with open(p, "w") as f:
                f.write(text)
        proc = Proc(cmd, cwd=cwd, env=env, stdin=paths[0], stdout=paths[1], stderr=paths[2])
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait(10)
            raise
        out, err = (open(p).read() for p in paths[1:])
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _kill_tree(pid: int) -> None:
    """A command that ran past its timeout goes with everything it started."""
    try:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        kids = []
    for k in kids:
        _kill_tree(int(k))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
