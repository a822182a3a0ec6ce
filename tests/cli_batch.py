"""Run many `meshspeed ...` command lines in ONE fresh interpreter, for tests of bad input.

Each bad-setting test used to start its own `python -m meshspeed`, paying the torch import
(2-10 s on a loaded 2-core machine) to check one line of stderr. The command lines here run one
after another through `meshspeed.cli.main` in a single child process, each with its own
captured stdout/stderr and exit code, so the tests still see exactly what a user would (the
real argument parsing, validation and run plan, in a process separate from pytest's).

Use `run_many([argv, ...], cwd)` -> [CliResult, ...]. Only for command lines that stop before
starting workers or that print help: anything that trains belongs in its own subprocess.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from dataclasses import dataclass

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_many(argvs: list[list[str]], cwd, timeout: float = 180, env: dict | None = None) -> list[CliResult]:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = warm.run(
        [sys.executable, "-m", "tests.cli_batch"],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    if out.returncode != 0:
        raise AssertionError(f"cli_batch itself failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return [CliResult(**r) for r in json.loads(out.stdout.splitlines()[-1])]


def _one(argv: list[str]) -> dict:
    from meshspeed.cli import main

    o, e = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = main(argv) or 0
        except SystemExit as stop:  # argparse and the CLI's one-line errors end this way
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - a traceback is what the test must see
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": o.getvalue(), "stderr": e.getvalue()}


if __name__ == "__main__":
    results = [_one(argv) for argv in json.loads(sys.stdin.read())]
    sys.stdout.write("\n" + json.dumps(results) + "\n")
