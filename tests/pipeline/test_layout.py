"""parallel.pp_layout parsing, the even split, and their errors."""

import pytest

from meshspeed.parallel.pipeline import ScheduleError, even_layout, format_layout, parse_layout


def test_parse_marked_layout():
    stages = parse_layout("E,t*8|t*8|t*8|t*7,L", pp=4, n_layers=31)
    assert [len(s.layers) for s in stages] == [8, 8, 8, 7]
    assert stages[0].layers == tuple(range(8)) and stages[3].layers == tuple(range(24, 31))
    assert [s.embedding for s in stages] == [True, False, False, False]
    assert [s.head for s in stages] == [False, False, False, True]


def test_counts_form_is_equivalent_and_round_trips():
    assert parse_layout("8,8,8,7", pp=4) == parse_layout("E,t*8|t*8|t*8|t*7,L", pp=4)
    stages = parse_layout("E|t*3|t,t|t*4,L", pp=2, vpp=2)
    assert format_layout(stages) == "E|t*3|t*2|t*4,L"  # canonical form
    assert parse_layout(format_layout(stages), pp=2, vpp=2) == stages


def test_vpp_stage_placement():
    stages = parse_layout("2,2,2,2,2,2", pp=3, vpp=2)
    assert [(s.rank, s.chunk) for s in stages] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert stages[3].layers == (6, 7)


def test_even_split_puts_remainder_before_the_last_stage():
    assert [len(s.layers) for s in even_layout(31, 4)] == [8, 8, 8, 7]
    assert [len(s.layers) for s in even_layout(30, 4, 2)] == [3, 4, 4, 4, 4, 4, 4, 3]
    assert [len(s.layers) for s in even_layout(32, 4)] == [8, 8, 8, 8]
    assert format_layout(even_layout(31, 4)) == "E,t*8|t*8|t*8|t*7,L"
    assert sum(len(s.layers) for s in even_layout(13, 5)) == 13


@pytest.mark.parametrize(
    "spec,pp,vpp,n,message",
    [
        ("E|t*8||t*8,L", 4, 1, None, "stage 2 is empty"),
        ("E,t*8|t*8|t*8|t*7,L", 4, 1, 32, "places 31 layers but the model has n_layers=32"),
        ("t*8|t*8|t*8", 4, 1, None, "has 3 stages but pp\\*vpp = 4"),
        ("8,8,8,8", 2, 1, None, "has 4 stages but pp\\*vpp = 2"),
        ("t*8|E,t*8", 2, 1, None, "E \\(embedding\\) is in stage 1"),
        ("t*8,L|t*8", 2, 1, None, "L \\(head \\+ loss\\) is in stage 0"),
        ("E,t*4,L,t|t", 2, 1, None, "layers after L"),
        ("x*3|t", 2, 1, None, "token 'x\\*3'"),
        ("", 2, 1, None, "parallel.pp_layout is empty"),
    ],
)
def test_layout_errors(spec, pp, vpp, n, message):
    with pytest.raises(ScheduleError, match=message):
        parse_layout(spec, pp, vpp, n)


def test_even_split_too_few_layers():
    with pytest.raises(ScheduleError, match="n_layers=3 cannot fill pp\\*vpp = 4 stages"):
        even_layout(3, 2, 2)
