"""What a `--layout-from` file may hold (issue 44, item 7): each value with its setting's type as
`meshspeed plan --json` writes it, a whole-number world size, JSON nested as the planner nests it;
anything else is one line naming the key and value (before: 2.0 refused as "not a number", a
negative or string world_size dropped silently, deep nesting a RecursionError traceback)."""

from __future__ import annotations

import json

import pytest

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan.planner import layout_overrides


def _file(tmp_path, body: str) -> str:
    path = tmp_path / "plan.json"
    path.write_text(body)
    return str(path)


def _plan(settings: dict, **extra) -> str:
    return json.dumps({"layouts": [{"settings": settings}], **extra})


@pytest.mark.parametrize(
    "body, needle",
    [
        (_plan({"parallel.tp": 2.0}), "layout 0's parallel.tp=2.0 must be a whole number"),
        (_plan({"parallel.tp": True}), "layout 0's parallel.tp=true must be a whole number"),
        (_plan({"parallel.sequence_parallel": 1}), "parallel.sequence_parallel=1 must be true or false"),
        (_plan({"memory.recompute": 0}), "layout 0's memory.recompute=0 must be a name"),
        (_plan({"parallel.tp": 2}, world_size=-4), "world_size=-4 must be a whole number ≥ 1"),
        (_plan({"parallel.tp": 2}, world_size="8"), 'world_size="8" must be a whole number ≥ 1'),
        (_plan({"parallel.tp": 2}, world_size=8.0), "world_size=8.0 must be a whole number ≥ 1"),
        ("[" * 100_000 + "]" * 100_000, "not a readable JSON file (nested too deeply)"),
        (b"\xff\xfe{}".decode("latin-1"), "not a readable JSON file"),
    ],
    ids=[
        "float",
        "bool-for-int",
        "int-for-bool",
        "int-for-name",
        "negative",
        "string",
        "float-world",
        "deep",
        "not-utf8",
    ],
)
def test_a_bad_value_is_one_line_naming_it(tmp_path, body, needle):
    path = _file(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        layout_overrides(path)
    msg = str(e.value)
    assert msg.startswith(f"--layout-from {path}") and needle in msg and "\n" not in msg, msg


def test_the_planners_own_file_reads_as_it_did(tmp_path):
    settings = {"parallel.tp": 2, "parallel.sequence_parallel": True, "memory.recompute": "full"}
    got = layout_overrides(_file(tmp_path, _plan(settings, world_size=8)))
    assert got == [
        ("nproc", "8"),
        ("parallel.tp", "2"),
        ("parallel.sequence_parallel", "true"),
        ("memory.recompute", "full"),
    ]


def test_a_deep_config_file_is_one_line(tmp_path):
    """--config takes the same bounded reading (a TOML file nested 100,000 deep)."""
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        config.load(str(path))
