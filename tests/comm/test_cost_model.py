"""The α-β-γ formulas, the choice they drive, and the fit that recovers known parameters."""

from __future__ import annotations

import math

import pytest

from meshspeed.comm import ConfigError
from meshspeed.comm import cost_model as cm

ONE_NODE4 = [0, 0, 0, 0]


def test_ring_all_reduce_formula():
    t = cm.terms("all_reduce", "ring", 4, 1000.0, ONE_NODE4, "gloo")
    assert t == {"p2p.intra.alpha": 6, "p2p.intra.beta": 1500.0, "p2p.intra.gamma": 750.0}


def test_halving_doubling_any_world_size():
    t8 = cm.terms("all_reduce", "hd", 8, 800.0, [0] * 8, "gloo")
    assert t8["p2p.intra.alpha"] == 2 * 3 and t8["p2p.intra.beta"] == pytest.approx(2 * 7 / 8 * 800)
    t6 = cm.terms("all_reduce", "hd", 6, 800.0, [0] * 6, "gloo")  # p2 = 4, r = 2: pre/post steps
    assert t6["p2p.intra.alpha"] == 2 * 2 + 2 and t6["p2p.intra.beta"] == pytest.approx(
        2 * 3 / 4 * 800 + 2 * 800
    )


def test_hierarchical_uses_both_link_classes():
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]  # 2 nodes × 4
    t = cm.terms("all_reduce", "hier", 8, 800.0, nodes, "nccl")
    assert t["p2p.intra.alpha"] == 2 * 3 and t["p2p.inter.alpha"] == 2 * 1
    assert t["p2p.inter.beta"] == pytest.approx(2 * 1 / 2 * 800 / 4)  # only 1/k of the data crosses nodes
    assert cm.terms("all_reduce", "ring", 8, 800.0, nodes, "nccl").keys() == {
        "p2p.inter.alpha",
        "p2p.inter.beta",
        "p2p.inter.gamma",
    }  # a flat ring runs at the slow link's speed


def test_bruck_has_log_latency_and_ring_linear():
    assert cm.terms("all_gather", "bruck", 5, 500.0, [0] * 5, "gloo")["p2p.intra.alpha"] == math.ceil(
        math.log2(5)
    )
    assert cm.terms("all_gather", "ring", 5, 500.0, [0] * 5, "gloo")["p2p.intra.alpha"] == 4
    assert "p2p.intra.gamma" not in cm.terms(
        "all_gather", "ring", 5, 500.0, [0] * 5, "gloo"
    )  # writes in place
    assert (
        cm.terms("all_gather", "bruck", 5, 500.0, [0] * 5, "gloo")["p2p.intra.gamma"] == 500.0
    )  # rotation copy
    assert cm.terms("reduce_scatter", "bruck", 5, 500.0, [0] * 5, "gloo")["p2p.intra.gamma"] == 800.0


def test_gloo_reduce_scatter_is_modelled_as_all_reduce():
    native = cm.terms("reduce_scatter", "native", 4, 1000.0, ONE_NODE4, "gloo")
    assert native["native.intra.beta"] == 1500.0  # twice the ring reduce-scatter's 750
    assert cm.terms("reduce_scatter", "native", 4, 1000.0, ONE_NODE4, "nccl")["native.intra.beta"] == 750.0


def test_choice_with_default_parameters():
    p = cm.LinkParams.defaults("gloo")
    assert cm.choose("all_reduce", 1 << 20, ONE_NODE4, "gloo", p) == "native"
    assert cm.choose("reduce_scatter", 4 << 20, ONE_NODE4, "gloo", p) == "ring"
    assert cm.choose("reduce_scatter", 1 << 10, [0] * 8, "gloo", p) == "bruck"  # latency-bound: log p steps
    assert cm.choose("reduce_scatter", 4 << 20, ONE_NODE4, "nccl", cm.LinkParams.defaults("nccl")) == "native"
    assert cm.choose("all_gather", 1 << 20, ONE_NODE4, "gloo", p, uneven=True) != "native"
    # several nodes with a slow inter-node link: the hierarchical all-reduce wins for big buffers
    slow = cm.LinkParams.defaults("nccl")
    slow.values["native.inter"] = (15e-6, 1 / 1e9, 1e-12)
    assert cm.choose("all_reduce", 256 << 20, [0] * 8 + [1] * 8, "nccl", slow) == "hier"


def test_fit_recovers_the_parameters_that_generated_the_rows():
    truth = cm.LinkParams.defaults("gloo")
    truth.values["p2p.intra"] = (70e-6, 1 / 1.7e9, 1 / 3.1e9)
    truth.values["native.intra"] = (25e-6, 1 / 2.2e9, 1 / 4.4e9)
    rows = []
    for op, algos in (
        ("all_reduce", ["native", "ring", "hd"]),
        ("all_gather", ["native", "ring", "bruck"]),
        ("reduce_scatter", ["native", "ring", "bruck"]),
    ):
        for algo in algos:
            for nbytes in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
                t = cm.predict(op, algo, nbytes, ONE_NODE4, "gloo", truth)
                rows.append({"op": op, "algo": algo, "bytes": nbytes, "time_us": t * 1e6})
    fitted = cm.fit(rows, ONE_NODE4, "gloo")
    for got, want in zip(fitted.values["p2p.intra"], truth.values["p2p.intra"]):
        assert got == pytest.approx(want, rel=1e-6)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        # per op, β and γ are inseparable: α is recovered exactly, β absorbs γ
        assert fitted.values[f"native:{op}.intra"][0] == pytest.approx(
            truth.values["native.intra"][0], rel=1e-6
        )
        for nbytes in (1 << 12, 1 << 24):
            assert cm.predict(op, "native", nbytes, ONE_NODE4, "gloo", fitted) == pytest.approx(
                cm.predict(op, "native", nbytes, ONE_NODE4, "gloo", truth), rel=1e-6
            )
    assert all(v["median_rel_err"] < 1e-9 for v in fitted.fitted.values())
    # a per-op native fit overrides the family's values in predictions
    fitted.values["native:all_reduce.intra"] = (1.0, 0.0, 0.0)
    assert cm.predict("all_reduce", "native", 10, ONE_NODE4, "gloo", fitted) == pytest.approx(6.0)


def _measured(p2p_intra=(1e-5, 2e-10, 3e-10)) -> cm.LinkParams:
    p = cm.LinkParams.defaults("gloo")
    p.values["p2p.intra"] = p2p_intra
    p.source, p.machine = "test", cm.this_machine()
    row = {"p": 4, "link": "intra", "bytes": 1024, "us": {"native": 9.0, "pairwise": 5.0}}
    p.measured = {"all_to_all": [row]}
    return p


def test_save_and_load_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHSPEED_LINK_PARAMS", str(tmp_path / "lp.json"))
    cm.save("gloo", _measured())
    back = cm.load("gloo")
    assert back.values["p2p.intra"] == (1e-5, 2e-10, 3e-10) and back.source == "test"
    assert back.measured == _measured().measured and back.path == str(tmp_path / "lp.json")
    assert cm.load("nccl").source.startswith("built-in")  # other backends untouched
    monkeypatch.setenv("MESHSPEED_LINK_PARAMS", "none")
    assert cm.load("gloo").source.startswith("built-in")


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda p: p.machine.update(host="another-host"), "another machine"),
        (lambda p: p.machine.update(torch="1.0.0"), "torch 1.0.0"),
        (lambda p: setattr(p, "measured", None), "another machine"),  # written before measurements were kept
    ],
)
def test_a_file_from_another_machine_or_torch_is_ignored_with_a_note(tmp_path, monkeypatch, change, needle):
    monkeypatch.setenv("MESHSPEED_LINK_PARAMS", str(tmp_path / "lp.json"))
    p = _measured(p2p_intra=(1.0, 1.0, 1.0))
    change(p)
    cm.save("gloo", p)
    back = cm.load("gloo")
    assert back.source.startswith("built-in") and back.values == cm.LinkParams.defaults("gloo").values
    assert needle in back.note and "bench comm" in back.note


def test_a_file_that_is_not_link_parameters_is_ignored_with_a_note(tmp_path, monkeypatch):
    bad = tmp_path / "lp.json"
    bad.write_text('{"gloo": [1, 2]}')
    monkeypatch.setenv("MESHSPEED_LINK_PARAMS", str(bad))
    back = cm.load("gloo")
    assert back.source.startswith("built-in") and "not a link-parameter file" in back.note


def test_measured_times_decide_not_the_fit():
    """A fit that predicts an algorithm faster does not choose it: only a measurement does, at
    the measured size nearest the call (issue 45: a fitted 530 µs α sent tp the slow way)."""
    p = cm.LinkParams.defaults("gloo")
    # a fit that makes every meshspeed algorithm look free
    p.values["p2p.intra"] = (1e-9, 1e-15, 1e-15)
    assert cm.choose("all_gather", 1 << 20, ONE_NODE4, "gloo", p) != "native"  # the fit alone
    p.measured = {
        "all_gather": [
            {"p": 4, "link": "intra", "bytes": 1 << 10, "us": {"native": 50.0, "ring": 40.0}},
            {"p": 4, "link": "intra", "bytes": 1 << 20, "us": {"native": 500.0, "ring": 700.0}},
        ],
    }
    assert cm.choose("all_gather", 1 << 20, ONE_NODE4, "gloo", p) == "native"  # measured slower
    assert cm.choose("all_gather", 3 << 19, ONE_NODE4, "gloo", p) == "native"  # nearest: 1 MiB
    assert cm.choose("all_gather", 1 << 11, ONE_NODE4, "gloo", p) == "ring"  # nearest: 1 KiB, ring won
    assert cm.choose("all_gather", 1 << 30, ONE_NODE4, "gloo", p) == "native"  # beyond: largest row
    # uneven sizes cannot run native: the fastest measured candidate
    assert cm.choose("all_gather", 1 << 20, ONE_NODE4, "gloo", p, uneven=True) == "ring"
    # a tie keeps the backend's own op
    p.measured["all_gather"][0]["us"]["ring"] = 50.0
    assert cm.choose("all_gather", 1 << 10, ONE_NODE4, "gloo", p) == "native"


def test_unmeasured_groups_keep_the_built_in_choice():
    """A file measured at 4 ranks says nothing about a 2-rank group or another op: those calls
    are chosen as with no file at all, whatever the fit says."""
    p = cm.LinkParams.defaults("gloo")
    p.values["p2p.intra"] = (1.0, 1.0, 1.0)  # a fit that makes meshspeed's algorithms hopeless
    p.measured = {"all_to_all": [{"p": 4, "link": "intra", "bytes": 1024, "us": {"native": 9.0}}]}
    d = cm.LinkParams.defaults("gloo")
    for op, n, nodes in (("reduce_scatter", 4 << 20, ONE_NODE4), ("all_to_all", 1024, [0, 0])):
        assert cm.choose(op, n, nodes, "gloo", p) == cm.choose(op, n, nodes, "gloo", d)
    assert cm.choose("reduce_scatter", 4 << 20, ONE_NODE4, "gloo", p) == "ring"


@pytest.mark.parametrize(
    "text,want",
    [
        ("ring", {"*": "ring"}),
        ("all_reduce=hd, all_gather=bruck", {"all_reduce": "hd", "all_gather": "bruck"}),
        ("", {}),
    ],
)
def test_algo_env_parsing(text, want):
    assert cm.parse_algo_env(text) == want


@pytest.mark.parametrize(
    "text,needle",
    [
        ("all_reduce=bruck", "unknown algorithm 'bruck' for all_reduce; valid: hd, hier, native, ring"),
        ("gather=ring", "unknown op 'gather'"),
        ("tree", "unknown algorithm 'tree'"),
    ],
)
def test_algo_env_errors(text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        cm.parse_algo_env(text)
