"""`sparsity.sparse_grad_comm` in the trainer, checked against the masks themselves rather than
against `pack=False` (which shares the packing plan): across RigL mask updates, on every step
that packs, each masked weight's reduced gradient is exactly zero where its current mask is off
and carries the gradient where it is on. A plan left over from before an update (the
trainer forgetting `masks_changed()`, or the plan cache ignoring it) breaks both."""

from __future__ import annotations

import torch

from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_sparsity import RIGL, _cfg

STEPS = 6  # updates after steps 2 and 4: packed steps follow each


def job_packed_steps(ctx, run_dir: str) -> list:
    extra = RIGL + [("parallel.tp", "1"), ("sparsity.sparse_grad_comm", "true"), ("train.steps", str(STEPS))]
    trainer = Trainer(_cfg(run_dir, extra), ctx)
    sgc, dp = trainer.sparsity.grad_comm, trainer.dp
    seen = []  # per step: (packed, masks changed since the last packed step, problems)
    masks_then = {}
    step_fn = trainer.opt.step

    def checked_step(*a, **k):
        if sgc.active:
            changed = any(not torch.equal(m, masks_then.get(n, m)) for n, m in sgc.masks.items())
            bad = []
            for name, mask in sgc.masks.items():
                s = dp.slots[name]
                grad = dp.reduced_grad(s.bucket, s.offset, s.offset + s.numel).view(mask.shape)
                if grad[~mask].count_nonzero():
                    bad.append(f"{name}: {int(grad[~mask].count_nonzero())} masked entries got gradient")
                if grad[mask].count_nonzero() < 0.9 * mask.sum():
                    bad.append(f"{name}: kept entries without gradient")
                masks_then[name] = mask.clone()
            seen.append((True, changed, bad))
        else:
            seen.append((False, False, []))
        return step_fn(*a, **k)

    trainer.opt.step = checked_step
    for s in range(STEPS):
        trainer.train_step(s)
    return seen


def test_packed_steps_follow_the_current_masks(tmp_path):
    for rank, seen in enumerate(harness.run(2, job_packed_steps, str(tmp_path))):
        assert [b for _, _, bad in seen for b in bad] == [], f"rank {rank}: {seen}"
        packed = [p for p, _, _ in seen]
        # dense at the steps whose update reads the gradients, packed otherwise; packed steps
        # right after an update run on masks that changed
        assert packed.count(True) >= 3 and any(c for _, c, _ in seen), seen
