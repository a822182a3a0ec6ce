"""Schedules are complete, ordered and deadlock-free; broken ones and bad input fail clearly."""

from collections import Counter

import pytest

from meshspeed.parallel.pipeline import (
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    B,
    DeadlockError,
    F,
    ScheduleError,
    W,
    build_schedule,
    format_schedule,
    get_schedule,
    insert_comms,
    parse_action,
    parse_schedule,
    simulate,
    validate,
)


def _cases():
    for name, fn in SCHEDULES.items():
        for pp in range(1, 6):
            for vpp in [fn.chunks] if fn.chunks else [2, 3] if fn.interleaved else [1]:
                if name == "dualpipev":  # m >= 2pp, any m from there (no multiple of pp needed)
                    ms = [2 * pp, 2 * pp + 1, 3 * pp + 2]
                elif fn.interleaved:
                    ms = [pp, 2 * pp, 3 * pp]
                else:
                    ms = sorted({1, 2, pp, pp + 1, 2 * pp + 3})
                for m in ms:
                    yield name, pp, vpp, m


@pytest.mark.parametrize("name,pp,vpp,m", list(_cases()))
def test_every_schedule_validates(name, pp, vpp, m):
    split = get_schedule(name).split_backward
    compute = build_schedule(name, pp, vpp, m, comms=False)
    expected = Counter({F: m * vpp, B: m * vpp, W: m * vpp if split else 0})
    for acts in compute:
        assert Counter(a.kind for a in acts) == +expected
    placement = get_schedule(name).placement
    validate(compute, pp, vpp, m, placement=placement)  # comms inserted inside
    validate(build_schedule(name, pp, vpp, m), pp, vpp, m, placement=placement)


def test_comms_follow_stage_placement_and_fifo_order():
    pp, vpp, m = 3, 2, 6
    sched = build_schedule("interleaved", pp, vpp, m)
    pairs = 0
    for src in range(pp):
        for dst in range(pp):
            out = [a for a in sched[src] if a.kind in (SEND_F, SEND_B) and a.peer == dst]
            got = [a for a in sched[dst] if a.kind in (RECV_F, RECV_B) and a.peer == src]
            assert len(out) == len(got)
            pairs += bool(out)
            _check_pairs(pp, src, dst, out, got)
    assert pairs == 2 * pp  # each rank talks to both ring neighbours (the ring closes for vpp > 1)
    # the last stage never sends forward, the first never sends a gradient
    assert not any(a.kind == SEND_F and a.chunk == vpp - 1 for a in sched[pp - 1])
    assert not any(a.kind == SEND_B and a.chunk == 0 for a in sched[0])


def _check_pairs(pp, src, dst, out, got):
    """The k-th receive on dst matches the k-th send from src (order-matched transports)."""
    for s, r in zip(out, got):
        # forward output of stage chunk*pp+src goes to the next stage, gradients to the previous one
        stage = s.chunk * pp + src
        nxt = stage + 1 if s.kind == SEND_F else stage - 1
        assert (r.kind, r.microbatch, nxt % pp, nxt // pp) == (
            {SEND_F: RECV_F, SEND_B: RECV_B}[s.kind],
            s.microbatch,
            dst,
            r.chunk,
        )


def test_no_comms_for_single_rank():
    sched = build_schedule("interleaved", 1, 3, 2)
    assert all(a.is_compute for a in sched[0])
    validate(sched, 1, 3, 2)


def test_action_text_round_trips():
    sched = build_schedule("zero-bubble", 3, 1, 4)
    assert parse_schedule(format_schedule(sched)) == sched
    assert str(Action(F, 3, 1)) == "F3.1"
    assert parse_action("sF3.1>2") == Action(SEND_F, 3, 1, 2)
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action("X3")


def _swap(acts, a, b):
    i, j = acts.index(parse_action(a)), acts.index(parse_action(b))
    acts[i], acts[j] = acts[j], acts[i]


def test_swapped_actions_deadlock_is_named():
    sched = build_schedule("1f1b", 4, 1, 8, comms=False)
    # rank 0 now waits for B0's gradient before sending F2 and F3 (in that swapped order F3 first), which
    # rank 1 needs before it can do B0: rank 1 receives in send order, so it blocks on F3
    _swap(sched[0], "F2.0", "B0.0")
    with pytest.raises(
        DeadlockError,
        match=r"deadlock between ranks 0 -> 1 -> 0: rank 0 blocks at rB0.0<1 .*gradient for B0.0 from rank 1"
        r".*rank 1 blocks at rF3.0<0",
    ):
        validate(sched, 4, 1, 8)


def test_missing_send_is_named():
    sched = build_schedule("1f1b", 2, 1, 2)
    sched[1].remove(parse_action("sB1.0>0"))
    with pytest.raises(
        DeadlockError, match="rank 0 blocks at rB1.0<1 .* from rank 1, which finished without sending it"
    ):
        simulate(sched, 2, 1)


def test_receives_out_of_send_order_are_caught():
    sched = build_schedule("interleaved", 2, 2, 2)
    _swap(sched[0], "rF0.1<1", "rF1.1<1")
    with pytest.raises(ScheduleError, match="rank 0: rF1.1<1 expects .* F1.1 but rank 1 sent F0.1 first"):
        simulate(sched, 2, 2)


def test_dropped_duplicated_and_misordered_actions():
    sched = build_schedule("1f1b", 4, 1, 8, comms=False)
    del sched[2][5]
    with pytest.raises(ScheduleError, match=r"rank 2 has no F3.0 \(forward of microbatch 3"):
        validate(sched, 4, 1, 8)
    sched = build_schedule("zero-bubble", 3, 1, 4, comms=False)
    sched[1].remove(Action(W, 2))
    with pytest.raises(ScheduleError, match="rank 1 has no W2.0"):
        validate(sched, 3, 1, 4)
    sched = build_schedule("1f1b", 4, 1, 8, comms=False)
    _swap(sched[3], "F0.0", "B0.0")
    with pytest.raises(ScheduleError, match="rank 3: B0.0 comes before F0.0"):
        validate(sched, 4, 1, 8)
    sched = build_schedule("gpipe", 2, 1, 2, comms=False)
    sched[0].append(Action(F, 1))
    with pytest.raises(ScheduleError, match="rank 0 runs F1.0 2 times"):
        validate(sched, 2, 1, 2)
    with pytest.raises(ScheduleError, match="schedule has 2 ranks but pp=3"):
        validate(build_schedule("gpipe", 2, 1, 2), 3, 1, 2)


@pytest.mark.parametrize(
    "name,pp,vpp,m,message",
    [
        ("interleaved", 4, 2, 6, "microbatches=6 must be a multiple of pp=4"),
        ("interleaved", 4, 2, 2, "microbatches=2 must be a multiple of pp=4"),
        ("interleaved", 4, 1, 8, "vpp=1 but an interleaved schedule needs vpp >= 2"),
        ("interleaved-extra-warmup", 2, 1, 4, "vpp=1 but an interleaved schedule needs vpp >= 2"),
        ("1f1b", 4, 2, 8, "1f1b: vpp=2 is not supported"),
        ("zero-bubble", 4, 3, 8, "zero-bubble: vpp=3 is not supported"),
        ("gpipe", 0, 1, 8, "gpipe: pp=0 is invalid; it must be an integer >= 1"),
        ("1f1b", 4, 1, 0, "microbatches=0 is invalid"),
        ("dualpipev", 4, 1, 8, "vpp=1 but an interleaved schedule needs vpp >= 2"),
        ("dualpipev", 4, 3, 8, "DualPipeV holds exactly 2 model chunks per rank; use vpp=2"),
        ("dualpipev", 4, 2, 7, r"microbatches=7 must be >= 2 \* pp = 8"),
    ],
)
def test_bad_input(name, pp, vpp, m, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, pp, vpp, m)


@pytest.mark.parametrize("m,good", [(6, 8), (2, 4)])
def test_bad_microbatches_carry_a_count_that_works(m, good):
    """The fix travels as data; each caller words it in its own settings."""
    with pytest.raises(ScheduleError) as err:
        build_schedule("interleaved", 4, 2, m)
    assert err.value.microbatches == good
    build_schedule("interleaved", 4, 2, good)


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(
        ScheduleError,
        match="'zb' is unknown; valid schedules: gpipe, 1f1b, interleaved, "
        "interleaved-extra-warmup, zero-bubble, dualpipev",
    ):
        get_schedule("zb")


def test_insert_comms_is_idempotent():
    sched = build_schedule("interleaved-extra-warmup", 3, 2, 6)
    assert insert_comms(sched, 3, 2) == sched


def test_receives_follow_send_order_even_when_consumed_out_of_order():
    # rank 1 runs microbatch 1 before microbatch 0; rank 0 sends 0 then 1. An order-matched
    # transport pairs the first send with the first receive, so rank 1 must receive 0 first.
    compute = parse_schedule(["F0 F1 B1 B0", "F1 F0 B1 B0"])
    sched = insert_comms(compute, 2, 1)
    assert format_schedule(sched[1:], show_chunk=False).split(": ")[1].startswith("rF0<0 rF1<0 F1 F0")
    validate(sched, 2, 1, 2)


# -- DualPipeV ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_v_placement_round_trips_and_folds_at_the_last_rank(pp):
    from meshspeed.parallel.pipeline import holder_of, stage_of

    for rank in range(pp):
        assert [stage_of(rank, c, pp, "v") for c in range(2)] == [rank, 2 * pp - 1 - rank]
        for c in range(2):
            assert holder_of(stage_of(rank, c, pp, "v"), pp, "v") == (rank, c)
    assert holder_of(0, pp, "v") == holder_of(2 * pp - 1, pp, "v")[:1] + (0,)  # embedding and loss: rank 0


def test_dualpipev_messages_follow_the_v():
    """Activations go down the ranks on chunk 0 and back up on chunk 1; the bottom of the V
    (stage pp-1 -> pp) stays on rank pp-1, so that rank sends nothing between its chunks."""
    pp, m = 4, 9
    sched = build_schedule("dualpipev", pp, 2, m)
    for rank, acts in enumerate(sched):
        for a in acts:
            if a.kind == SEND_F:
                assert a.peer == (rank + 1 if a.chunk == 0 else rank - 1), (rank, a)
            if a.kind == SEND_B:
                assert a.peer == (rank - 1 if a.chunk == 0 else rank + 1), (rank, a)
    assert not any(a.kind in (SEND_F, SEND_B) and a.peer == pp - 1 for a in sched[pp - 1])
    # rank 0 ends the pipeline: its chunk 1 sends no activation, its chunk 0 no gradient
    assert not any(a.kind == SEND_F and a.chunk == 1 for a in sched[0])
    assert not any(a.kind == SEND_B and a.chunk == 0 for a in sched[0])


def test_dualpipev_phases_as_deepseek_builds_them():
    """Rank r: 2(pp-r-1) forwards of chunk 0, then r+1 F0/F1 pairs, then the steady F0 B1 F1 B0
    with full backwards (B right before its W), and every W once."""
    pp, m = 4, 10
    compute = build_schedule("dualpipev", pp, 2, m, comms=False)
    for r, acts in enumerate(compute):
        fill = 2 * (pp - r - 1)
        assert acts[:fill] == [Action(F, i, 0) for i in range(fill)]
        assert acts[fill : fill + 2] == [Action(F, fill, 0), Action(F, 0, 1)]
        text = format_schedule([acts]).split(": ")[1]
        steady = m - 2 * pp + r + 1
        assert text.count("B") == text.count("W") == 2 * m
        # the steady phase's pairs: a forward next to a backward of the other chunk
        pairs = sum(1 for a, b in zip(acts, acts[1:]) if a.kind == F and b.kind == B and a.chunk != b.chunk)
        assert pairs >= 2 * steady


def test_overlapped_pairs_keep_the_step_and_move_receives_first():
    from meshspeed.parallel.pipeline.pairs import candidates, overlapped

    for name, pp, vpp, m in [("dualpipev", 4, 2, 10), ("dualpipev", 3, 2, 7), ("1f1b", 4, 1, 8)]:
        fn = get_schedule(name)
        sched = build_schedule(name, pp, vpp, m)
        plain = simulate(sched, pp, vpp, split=fn.split_backward, placement=fn.placement)
        executed, starts = overlapped(sched, pp, vpp, fn.placement, fn.split_backward)
        run = simulate(executed, pp, vpp, split=fn.split_backward, placement=fn.placement)
        assert run.makespan == plain.makespan and run.bubble == plain.bubble
        for rank, acts in enumerate(executed):
            assert sorted(map(str, acts)) == sorted(map(str, sched[rank]))  # a reordering only
            for i in starts[rank]:
                f = acts[i]
                j = next(k for k in range(i + 1, len(acts)) if acts[k].is_compute)
                assert f.kind == F and acts[j].kind == B
                assert all(a.kind == SEND_F for a in acts[i + 1 : j])  # only F's own sends between
        n = sum(map(len, starts))
        if name == "1f1b":  # every 1F1B gradient arrives just after the forward before it
            assert n == 0 < len(candidates(sched, pp))
        else:  # all steady pairs but the last rank's first (which DualPipe leaves apart too)
            steady = sum(2 * (m - 2 * pp + r + 1) for r in range(pp))
            assert n >= steady - 1


def test_a_pair_whose_gradient_comes_late_is_not_overlapped():
    """1F1B rank 0 at pp 2: F1 B0 is a candidate, but B0's gradient leaves rank 1 only after
    rank 1 ran F0 and B0, i.e. after rank 0 started F1; receiving it first would stall."""
    from meshspeed.parallel.pipeline.pairs import candidates, overlapped

    sched = build_schedule("1f1b", 2, 1, 4)
    assert (0, sched[0].index(Action(F, 1)), sched[0].index(Action(B, 0))) in candidates(sched, 2)
    assert overlapped(sched, 2, 1)[1] == [[], []]
