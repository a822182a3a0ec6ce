"""Pipeline parallelism as data: schedules, communication insertion, validation, simulation,
drawing and stage layouts. Pure Python, so `meshspeed pipeline show` needs no torch.

The torch side is imported from its modules, not from here: stage.py (cut the model into
stages), runtime.py (execute a schedule over meshspeed.comm; its p2p in stage_comm.py, the
B/W split in split_backward.py, overlapped F/B pairs in duet.py) and trace.py (a real run's
timeline next to the simulated one). pairs.py (which F/B pairs a runtime may overlap) is data.
"""

from meshspeed.parallel.pipeline.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    PLACEMENTS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    format_schedule,
    holder_of,
    parse_action,
    parse_schedule,
    stage_of,
)
from meshspeed.parallel.pipeline.analysis import closed_form, evaluate, fb_overlap
from meshspeed.parallel.pipeline.comms import insert_comms
from meshspeed.parallel.pipeline.draw import ascii_timeline, draw_png, to_json
from meshspeed.parallel.pipeline.layout import StageLayout, even_layout, format_layout, parse_layout
from meshspeed.parallel.pipeline.schedules import SCHEDULES, build_schedule, get_schedule
from meshspeed.parallel.pipeline.simulate import Costs, DeadlockError, SimResult, Span, simulate
from meshspeed.parallel.pipeline.validate import validate

__all__ = [
    "Action",
    "F",
    "B",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "PLACEMENTS",
    "ScheduleError",
    "DeadlockError",
    "format_schedule",
    "parse_action",
    "parse_schedule",
    "stage_of",
    "holder_of",
    "SCHEDULES",
    "get_schedule",
    "build_schedule",
    "insert_comms",
    "validate",
    "Costs",
    "SimResult",
    "Span",
    "simulate",
    "closed_form",
    "evaluate",
    "fb_overlap",
    "ascii_timeline",
    "draw_png",
    "to_json",
    "StageLayout",
    "parse_layout",
    "even_layout",
    "format_layout",
]
