"""Sequence parallelism for the vision-language model (vlm-tiny) in the real Trainer equals one
process: per-step caption losses, gradient norms and the validation loss under tp 2 + SP,
dp 2 × tp 2 + SP and pp 2 × tp 2 + SP, in the pooled gloo workers.

Under SP the embedding unit (token embedding, ViT, projector) runs whole on every tp rank, so the
image features are scattered into the whole sequence; only its output is cut to seq/tp (the
recipe's sp_split), and the decoder blocks read the whole M-RoPE tables. The one-process run,
its settings and the tolerances are test_vlm_trainer's.
"""

from __future__ import annotations

import pytest

from tests import harness
from tests.train import test_vlm_trainer as vlm

SP = [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]
LAYOUTS = [
    ("tp2-sp", 2, SP),
    ("dp2-tp2-sp", 4, SP),
    ("pp2-tp2-sp", 4, [("parallel.pp", "2")] + SP),
]


@pytest.mark.parametrize("name,ws,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_sequence_parallel_equals_one_process(tmp_path_factory, name, ws, extra):
    want = vlm.reference(tmp_path_factory)
    got = harness.run(ws, vlm.job_rows, str(tmp_path_factory.mktemp(f"vlm-{name}")), extra)
    vlm.assert_rows_equal(got, want, name)
