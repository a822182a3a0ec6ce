"""A synthetic post-training task made in code: short arithmetic questions (issue 42's laptop example).

"What is 17+25?" → "42": additions of two numbers 0-99 and subtractions a-b with 0 ≤ b ≤ a ≤ 99,
each question at most once (15,050 exist). For DPO the chosen answer is the right one and the
rejected one a near miss: the answer ±1, ±2 or ±10, or its two digits swapped, never negative and
never the answer itself, so telling them apart takes the arithmetic, not the format.

Deterministic from the seed: the same seed and count give the same files byte for byte. The
**held-out split is by question**: the last ⌈val_fraction × count⌉ questions are in the `.val`
files of both the SFT and the DPO data and in neither `.train` file, so held-out preference
accuracy and exact match measure questions never trained on.

Files (TRL's conversational formats, read by chat.py):
    sft.train.jsonl / sft.val.jsonl      {"messages": [user question, assistant answer]}
    pairs.train.jsonl / pairs.val.jsonl  {"prompt": [user], "chosen": [assistant], "rejected": [assistant]}
"""

from __future__ import annotations

import json
import math
import os
import random

from meshspeed.comm import outputs
from meshspeed.data.corpus import DataError

MAX_OPERAND = 99
N_ADD = (MAX_OPERAND + 1) ** 2
N_SUB = (MAX_OPERAND + 1) * (MAX_OPERAND + 2) // 2
N_QUESTIONS = N_ADD + N_SUB
DEFAULT_COUNT = 4000
DEFAULT_VAL_FRACTION = 0.1
FILES = ("sft.train.jsonl", "sft.val.jsonl", "pairs.train.jsonl", "pairs.val.jsonl")


def question(index: int) -> tuple[str, int]:
    """The index-th question of the fixed enumeration (additions, then subtractions) and its answer."""
    if index < N_ADD:
        a, b = divmod(index, MAX_OPERAND + 1)
        return f"What is {a}+{b}?", a + b
    k = index - N_ADD  # k-th (a, b) with b ≤ a, row by row: a = the largest with a(a+1)/2 ≤ k
    a = (math.isqrt(8 * k + 1) - 1) // 2
    b = k - a * (a + 1) // 2
    return f"What is {a}-{b}?", a - b


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong answer close to the right one (module docstring)."""
    options = {answer + d for d in (-10, -2, -1, 1, 2, 10)}
    s = str(answer)
    if len(s) == 2 and s[0] != s[1] and s[1] != "0":
        options.add(int(s[::-1]))
    return rng.choice(sorted(o for o in options if o >= 0 and o != answer))


def arith_records(
    count: int = DEFAULT_COUNT, seed: int = 0, val_fraction: float = DEFAULT_VAL_FRACTION
) -> dict[str, list[dict]]:
    """{file name: records} for FILES."""
    if not isinstance(count, int) or not 2 <= count <= N_QUESTIONS:
        raise DataError(f"--count={count!r} must be an integer in [2, {N_QUESTIONS}] (questions), e.g. 4000")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction={val_fraction} must be in (0, 1) for arith, e.g. 0.1")
    rng = random.Random(seed)
    picks = rng.sample(range(N_QUESTIONS), count)
    n_val = min(max(1, math.ceil(val_fraction * count)), count - 1)
    out: dict[str, list[dict]] = {name: [] for name in FILES}
    for i, idx in enumerate(picks):
        q, ans = question(idx)
        split = "val" if i >= count - n_val else "train"
        user = [{"role": "user", "content": q}]
        out[f"sft.{split}.jsonl"].append({"messages": user + [{"role": "assistant", "content": str(ans)}]})
        out[f"pairs.{split}.jsonl"].append({
            "prompt": user,
            "chosen": [{"role": "assistant", "content": str(ans)}],
            "rejected": [{"role": "assistant", "content": str(near_miss(ans, rng))}],
        })  # fmt: skip
    return out


def write_arith(
    out: str,
    count: int = DEFAULT_COUNT,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    overwrite: bool = False,
) -> dict[str, int]:
    """Write FILES into directory `out` (whole or not at all); returns {file name: records}."""
    if not out:
        raise DataError("--out is required for --kind arith: the directory to write, e.g. data/arith")
    records = arith_records(count, seed, val_fraction)
    outputs.check_target_dir(out, "--out", overwrite, lambda name: name in FILES)
    outputs.clean_orphans(out)
    stage = outputs.sibling(out)
    os.makedirs(stage)
    try:
        for name, recs in records.items():
            with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        outputs.commit_dir(stage, out, list(FILES))
    except OSError as e:
        raise outputs.disk_error(e, out) or e from None
    return {name: len(recs) for name, recs in records.items()}


def answer_of(text: str) -> str:
    """A generated answer as compared for exact match: up to the end-of-turn, spaces trimmed."""
    return text.split("\0", 1)[0].strip()
