"""Which tests have a CUDA path, for benchmarks/gpu_report.py: test files that mention CUDA at
all (a grep), then, collected by pytest with this module as a plugin (`-p benchmarks.gpu_tests`,
GPU_REPORT_SELECT=1), the tests whose skip reason, parameters, module or own source names CUDA:
they run, or would run, differently on a GPU. Their results come back as junit XML counts."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_test_files() -> list[str]:
    """Test files that mention CUDA at all (this report's own test excluded: it runs the report)."""
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, "tests")):
        for f in sorted(files):
            path = os.path.join(d, f)
            if f.startswith("test_") and f.endswith(".py") and f != "test_gpu_report.py":
                with open(path) as fh:
                    if "cuda" in fh.read().lower():
                        out.append(os.path.relpath(path, ROOT))
    return sorted(out)


def has_cuda_path(item) -> bool:
    """A test whose skip reason, parameters, module or own source names CUDA: it runs (or would
    run) differently on a GPU."""
    module = getattr(item, "module", None)
    if module is not None and (
        module.__name__.rsplit(".", 1)[-1].startswith("test_cuda_")
        or getattr(module, "DEVICE", None) == "cuda"
    ):
        return True
    for mark in item.iter_markers("skipif"):
        if re.search(r"cuda|gpu", str(mark.kwargs.get("reason", "")), re.I):
            return True
    if "cuda" in json.dumps(getattr(getattr(item, "callspec", None), "params", {}), default=str).lower():
        return True
    try:
        return "cuda" in inspect.getsource(item.obj).lower()
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    """As a pytest plugin (-p benchmarks.gpu_tests, with GPU_REPORT_SELECT=1): keep the tests
    with a CUDA path."""
    if os.environ.get("GPU_REPORT_SELECT") != "1":
        return
    keep = [i for i in items if has_cuda_path(i)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def selection_args(xml: str) -> list[str]:
    """`python` arguments of a pytest run that keeps the CUDA-path tests and writes `xml`."""
    args = ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "benchmarks.gpu_tests", "--junitxml", xml]
    if importlib.util.find_spec("pytest_timeout"):  # a hung test fails alone, not the whole run
        args += ["--timeout", "150"]
    return args


def junit_counts(xml: str, stdout: str = "") -> dict:
    """{"passed", "failed", "skipped": counts, "failed_tests": ids} of a junit XML file, or, when
    pytest wrote none (it was stopped: the file comes at the end), of its -v lines so far."""
    out, failed = {"passed": 0, "failed": 0, "skipped": 0}, []
    if not os.path.exists(xml):
        lines = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", stdout, re.M)
        for test, result in lines:
            kind = {"ERROR": "failed", "XFAIL": "skipped", "XPASS": "passed"}.get(result, result.lower())
            out[kind] += 1
            failed += [test] * (kind == "failed")
        return {**out, "failed_tests": failed, "incomplete": True}
    why = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        kind = {"failure": "failed", "error": "failed"}.get(bad.tag, bad.tag) if bad is not None else "passed"
        out[kind] += 1
        if kind == "failed":
            test = f"{case.get('classname')}::{case.get('name')}"
            failed.append(test)
            # the assertion's own line and the traceback's last lines: what a fix needs to know
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            why[test] = "\n".join(line for line in text.strip().splitlines()[-12:])[:1500]
    return {**out, "failed_tests": failed, "why": why}
