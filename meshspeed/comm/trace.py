"""Flight recorder: the last N collectives this rank issued, kept in a bounded ring buffer.

When a job hangs the question is always "what was each rank doing?". Every collective that
goes through meshspeed.comm gets an entry here (sequence number, op, group, shape, dtype,
algorithm, start/end, state), so a timeout error can quote the tail and a dump file can be
compared across ranks. Recording is a dict append: cheap enough to leave on always.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import torch

_DTYPE_SHORT = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def describe(op: str, shape: Any, dtype: str, extra: str = "") -> str:
    """`all_reduce([4, 8] bf16)` — the form used in every error message."""
    tail = f" {extra}" if extra else ""
    return f"{op}({list(shape)} {dtype}{tail})"


class FlightRecorder:
    """Bounded per-rank log of collectives. Entries are plain dicts so they dump as JSON."""

    def __init__(self, rank: int, capacity: int = 2000):
        self.rank = rank
        self.entries: collections.deque[dict] = collections.deque(maxlen=capacity)

    def record(self, seq: int, group: str, op: str, shape, dtype: str, algo: str, nbytes: int) -> dict:
        entry = {
            "seq": seq,
            "group": group,
            "op": op,
            "shape": list(shape),
            "dtype": dtype,
            "algo": algo,
            "bytes": nbytes,
            "start": time.time(),
            "end": None,
            "state": "started",
        }
        self.entries.append(entry)
        return entry

    @staticmethod
    def finish(entry: dict | None, state: str = "completed") -> None:
        if entry is not None:
            entry["end"] = time.time()
            entry["state"] = state

    def tail(self, n: int = 5) -> list[dict]:
        return list(self.entries)[-n:]

    def mark(self) -> dict | None:
        """The newest entry: `since(mark)` lists what was recorded after it."""
        return self.entries[-1] if self.entries else None

    def since(self, mark: dict | None) -> list[dict]:
        """Entries recorded after `mark` (all of them if mark is None or has left the log)."""
        entries = list(self.entries)
        for i in range(len(entries) - 1, -1, -1):
            if entries[i] is mark:
                return entries[i + 1 :]
        return entries

    def format_tail(self, n: int = 5) -> str:
        lines = []
        for e in self.tail(n):
            dur = f"{(e['end'] - e['start']) * 1e6:.0f}us" if e["end"] else "-"
            lines.append(
                f"    seq {e['seq']:>5} {e['group']:<14} "
                f"{describe(e['op'], e['shape'], e['dtype'])} algo={e['algo']} {e['state']} {dur}"
            )
        return "\n".join(lines) if lines else "    (no collectives recorded)"

    def dump(self, path: str) -> str:
        """Write the buffer as JSON (atomically: a half-written dump is worse than none)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "entries": list(self.entries)}, f, indent=1)
        os.replace(tmp, path)
        return path
