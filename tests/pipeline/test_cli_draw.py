"""`meshspeed pipeline show`, the ASCII timeline, JSON and PNG output."""

import argparse
import json
import sys

import pytest

from meshspeed.commands import pipeline as cmd
from meshspeed.parallel.pipeline import ascii_timeline, draw_png, evaluate, to_json


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="meshspeed")
    cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show_1f1b_prints_3_over_11(capsys):
    code, out, _ = run(["pipeline", "show", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8"], capsys)
    assert code == 0
    assert "bubble            3/11 = 0.2727   closed form (p-1)/(m+p-1) = 3/11" in out
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1" in out
    assert "makespan          33" in out
    assert "rank 0: 4  rank 1: 3  rank 2: 2  rank 3: 1" in out


def test_show_all_compares_every_schedule(capsys, tmp_path):
    code, out, _ = run(
        [
            "pipeline",
            "show",
            "--schedule",
            "all",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--vpp",
            "2",
            "--json",
            str(tmp_path / "all.json"),
        ],
        capsys,
    )
    assert code == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln and ln.split()[0] in cmd_names()}
    assert "3/11" in lines["1f1b"] and "3/11" in lines["gpipe"]
    assert "3/19" in lines["interleaved"] and "1/9" in lines["zero-bubble"]
    doc = json.loads((tmp_path / "all.json").read_text())
    assert [d["schedule"] for d in doc["schedules"]] == cmd_names()


def cmd_names():
    from meshspeed.parallel.pipeline import SCHEDULES

    return list(SCHEDULES)


def test_show_bad_input_is_one_line(capsys):
    code, _, err = run(["pipeline", "show", "--schedule", "interleaved", "--pp", "4", "-m", "6"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "microbatches=6 must be a multiple of pp=4" in err


def test_json_round_trip():
    doc = json.loads(to_json(evaluate("zero-bubble", 3, 1, 4)))
    assert doc["bubble_exact"] == "1/7" and doc["split_backward"] is True
    assert doc["timeline"][0][0] == [0.0, 1.0, "F0.0"]
    assert "sF0.0>1" in doc["actions"][0]


def test_ascii_timeline_shows_every_action_and_idle():
    text = ascii_timeline(evaluate("1f1b", 4, 1, 8))
    rows = [ln for ln in text.splitlines() if ln.startswith("rank")]
    assert len(rows) == 4
    assert rows[3].startswith("rank 3: .........F0 B0")
    assert all(f"B{i}" in row for row in rows for i in range(8))
    chunked = ascii_timeline(evaluate("interleaved", 2, 2, 2))
    assert "rank 0 c0:" in chunked and "c1:" in chunked


def test_png_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "il.png"
    code, text, _ = run(
        ["pipeline", "show", "--schedule", "interleaved", "--vpp", "2", "--png", str(out)], capsys
    )
    assert code == 0 and f"wrote {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_png_without_matplotlib_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(RuntimeError, match="matplotlib is needed for --png; pip install matplotlib"):
        draw_png(evaluate("1f1b", 2, 1, 2), str(tmp_path / "x.png"))
