"""benchmarks/cslt_probe.py (the GPU probe of the compiled 2:4 compression kernel) reads a planted
difference the way its docstring says, and benchmarks/gpu_report.py runs it as its cslt section.
No kernel runs here: the probe's GPU comparisons are its business on a GPU."""

from __future__ import annotations

import torch

from benchmarks import cslt_probe, gpu_report
from meshspeed.sparse import cslt_layout

R, C = 128, 256


def _packed() -> torch.Tensor:
    w, m = cslt_probe.make(R, C, signed=True)
    return cslt_layout.compress_reference(torch.where(m, w, 0), m)


def test_the_probe_names_swapped_nibbles_and_nothing_else(capsys):
    want = _packed()
    cslt_probe.diff("same", want, want.clone(), R, C)
    got = want.clone()
    meta = got.view(torch.uint8)[R * C :]  # the metadata bytes, after the values
    meta.copy_((meta >> 4) | (meta << 4))  # every byte's two nibbles swapped (rows r and r + 8)
    cslt_probe.diff("planted", got, want, R, C)
    same, planted = capsys.readouterr().out.strip().splitlines()
    assert same.endswith("same: equal")
    differ = int((meta != want.view(torch.uint8)[R * C :]).sum())
    assert differ > 0
    assert f"VALUES 0/{R * C} B" in planted and f"META {differ}/{R * C // 8} B" in planted
    assert f"nibbles swapped {differ};" in planted


def test_gpu_report_runs_the_probe_before_the_cuda_tests(tmp_path):
    assert gpu_report.SECTIONS.index("cslt") < gpu_report.SECTIONS.index("tests")
    rep = gpu_report.Report("dry", 330, str(tmp_path))
    gpu_report.RUNNERS["cslt"](rep, str(tmp_path))
    assert rep.data["not_run"] == ["benchmarks/cslt_probe.py: --dry"]
    probe = dict(rc=0, seconds=9.5, lines="[ 1.0s] 128x256 W   K vs R: equal", err="")
    rep.data.update(seconds=1.0, cslt=probe)
    text = gpu_report.markdown(rep.data)
    assert "## benchmarks/cslt_probe.py (rc 0, 9.5 s)" in text and "K vs R: equal" in text
