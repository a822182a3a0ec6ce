"""Real processes for fault injection: start `meshspeed train` (or `run`, or torchrun), find its workers,
inject a fault from outside (a signal, a file change), and wait for the end with a bound.

Every wait is bounded by a subprocess timeout, so a hang fails its test instead of stalling CI;
no test asserts how fast something ran. Each job runs in its own session, and whatever is left
of it is SIGKILLed when the test ends, so a failing test leaks no processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests import warm

# A tiny run that starts in seconds: 32-token sequences, one micro-batch per rank per step.
FAST = [
    "--train.seq_len",
    "32",
    "--train.global_batch_size",
    "4",
    "--train.micro_batch_size",
    "2",
    "--data.max_mb",
    "1",
    "--train.eval_interval",
    "0",
    "--run.log_interval",
    "1",
    "--train.warmup_steps",
    "2",
]
COMM_TIMEOUT = 10  # seconds: --run.timeout in these tests (the collective timeout)


def env() -> dict[str, str]:
    """This process's environment without a job's variables (the children form their own job)."""
    out = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("TORCHELASTIC_")
    }
    out.update(PYTHONUNBUFFERED="1", MESHSPEED_LINK_PARAMS="none", OMP_NUM_THREADS="1")
    return out


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), rest[0]
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")  # a zombie has exited


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] == pid and st[1] not in ("Z", "X"):
                out.append(int(name))
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Job:
    """One `meshspeed train` (or `meshspeed run`, or torchrun) process tree, with its output in files."""

    def __init__(
        self,
        tmp_path,
        args: list[str],
        *,
        torchrun: list[str] | None = None,
        name: str = "job",
        extra_env: dict[str, str] | None = None,
        command: str = "train",
    ):
        self.dir = tmp_path
        self.out_path, self.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        if torchrun is None:
            cmd = [sys.executable, "-m", "meshspeed", command, *args]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *torchrun,
                "-m",
                "meshspeed",
                "train",
                *args,
            ]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = warm.popen(
                cmd,
                stdout=out,
                stderr=err,
                env={**env(), **(extra_env or {})},
                cwd=tmp_path,
                start_new_session=True,
            )
        self.started = time.monotonic()
        self.seen: set[int] = set()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    def last_line(self) -> str:
        lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def workers(self, n: int, timeout: float = 60.0) -> list[int]:
        """The pids of the `n` workers, in rank order (the launcher starts rank 0 first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                p
                for p in children(self.proc.pid)
                # spawned; forked from the launcher (its command line); or forked from a launcher
                # that tests/warm.py forked from the fork server (the server's command line)
                if any(k in cmdline(p) for k in ("spawn_main", " meshspeed train", "forkserver import main"))
            ]
            if len(found) == n:
                self.seen.update(found)
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"expected {n} workers, found {children(self.proc.pid)}; stderr:\n{self.stderr[-2000:]}"
        )

    def wait_for(self, what: str, cond, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the job ended (code {self.proc.returncode}) before {what}; "
                    f"stderr:\n{self.stderr[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g}s; stderr:\n{self.stderr[-3000:]}")
            time.sleep(0.1)

    def wait_rows(self, run_dir, n: int, timeout: float = 120.0) -> None:
        path = run_dir / "metrics.jsonl"
        rows = lambda: path.exists() and len(path.read_text().splitlines()) >= n  # noqa: E731
        self.wait_for(f"{n} metrics rows", rows, timeout)

    def finish(self, timeout: float) -> int:
        """The exit code; a job still running after `timeout` seconds is a hang: fail."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end within {timeout:g}s (a hang); stderr:\n{self.stderr[-3000:]}"
            ) from None

    def gone(self, pids, timeout: float = 30.0) -> list[int]:
        """Wait until none of `pids` is alive; return those still alive after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [p for p in pids if alive(p)]
            if not left:
                return []
            time.sleep(0.1)
        return [p for p in pids if alive(p)]

    def kill_all(self) -> None:
        """Test clean-up: SIGKILL whatever is left of the job."""
        for pid in list(self.seen) + [self.proc.pid]:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
