"""The trainer's diffusion pieces, kept out of trainer.py: the EMA of the weights that a flow run
keeps (`flow.ema_decay` > 0), saved in the checkpoint and used by `meshspeed sample`.

The average is taken over exactly what this rank's optimizer updates: bucket i's `param_slice`
(parallel/data.py) — the whole bucket without ZeRO, this rank's 1/dp slice under ZeRO-1/2, its
shard under ZeRO-3 (where the parameters hold no bytes between forwards) — each in the rank's
tensor-parallel layout. The update is elementwise, so averaging the pieces is averaging the
whole: no collective per step, EMA memory is 1/dp of the weights under ZeRO, and the numbers
are those of one process (train/ema.py keeps them in float32).

In the checkpoint the EMA is whole tensors by parameter name in `extra["ema"]` (gathered over dp
and tp when saving, sliced back when resuming): any layout resumes it exactly, and sampling (a
dp-only model) loads it as it loads the weights.
"""

from __future__ import annotations

import json

import torch

from meshspeed import comm
from meshspeed.comm import placement
from meshspeed.train.ema import EMA


class NoEMA:
    """flow.ema_decay = 0 (and every other objective): nothing kept, saved or restored."""

    def update(self) -> None:
        pass

    def extra(self) -> dict:
        return {}

    def load(self, extra: dict | None, lead: bool = False) -> None:
        pass


class BucketEMA(NoEMA):
    def __init__(self, dp, mesh, decay: float):
        self.dp, self.mesh = dp, mesh
        self.ema = EMA(self._named(), decay)

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        # param_slice(i): where the optimizer has just written bucket i's updated values
        return [(f"bucket{i}", self.dp.param_slice(i)) for i in range(len(self.dp.buckets))]

    def update(self) -> None:
        """After each optimizer step that was taken (a skipped step leaves the weights as they were)."""
        self.ema.update(self._named())

    def whole(self) -> dict[str, torch.Tensor]:
        """Every parameter's average, whole (float32), by name: collective over dp and tp."""
        out = {}
        for i, spec in enumerate(self.dp.specs):
            shadow = self.ema.shadow[f"bucket{i}"]
            flat = shadow
            if shadow.numel() != spec.numel:  # a ZeRO slice: equal slices (numel is a multiple)
                flat = comm.all_gather(shadow.contiguous(), self.dp.group_of(i))
            for s in spec.slots:
                local = flat[s.offset : s.offset + s.numel].view(s.shape)
                sharding = placement.sharding_of(self.dp.params[s.name])  # tp's split, if any
                out[s.name] = placement.full_tensor(local, self.mesh, sharding).cpu().clone()
        return self._across_stages(out) if self.mesh["pp"].size > 1 else out

    def _across_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pipeline stage's averages on every rank (collective over pp): the names and
        shapes travel as JSON bytes, the values as one flat float32 vector per stage."""
        pp, dev = self.mesh["pp"], self.mesh.ctx.device
        head = torch.tensor(
            list(json.dumps([[n, list(t.shape)] for n, t in mine.items()]).encode()), dtype=torch.uint8
        )
        lens = comm.all_gather(torch.tensor([head.numel()], device=dev), pp).tolist()
        heads = comm.all_gather(head.to(dev), pp, sizes=lens).cpu().split(lens)
        layout = [json.loads(bytes(h.tolist()).decode()) for h in heads]  # per stage: [[name, shape]]
        counts = [sum(torch.Size(shape).numel() for _, shape in stage) for stage in layout]
        flat = torch.cat([t.reshape(-1) for t in mine.values()]) if mine else torch.zeros(0)
        flats = comm.all_gather(flat.float().to(dev), pp, sizes=counts).cpu().split(counts)
        out = {}
        for stage, values in zip(layout, flats, strict=True):
            for (name, shape), v in zip(
                stage, values.split([torch.Size(s).numel() for _, s in stage]), strict=True
            ):
                out[name] = v.reshape(shape).clone()
        return out

    def extra(self) -> dict:
        e = self.ema
        return {"ema": {"decay": e.decay, "updates": e.updates, "weights": self.whole()}}

    @torch.no_grad()
    def load(self, extra: dict | None, lead: bool = False) -> None:
        """Restore the average a checkpoint saved (bit for bit, in any layout). A checkpoint
        saved without one (EMA turned on at resume) starts the average from its weights."""
        state = (extra or {}).get("ema")
        if state is None:
            self.ema = EMA(self._named(), self.ema.decay)
            if lead:
                print("meshspeed: the checkpoint holds no EMA; it starts from its weights", flush=True)
            return
        weights = state["weights"]
        for i, spec in enumerate(self.dp.specs):
            shadow = self.ema.shadow[f"bucket{i}"]
            flat = torch.zeros(spec.numel, dtype=torch.float32)
            for s in spec.slots:
                piece = weights[s.name]
                sharding = placement.sharding_of(self.dp.params[s.name])
                for dim, p in sharding.axes if sharding is not None else ():  # the inverse of full_tensor
                    g = self.mesh[dim]
                    piece = placement.local_piece(piece, p, g.rank, g.size)
                flat[s.offset : s.offset + s.numel] = piece.reshape(-1)
            lo, hi = (0, spec.numel) if shadow.numel() == spec.numel else self.dp.dp_shard(i)
            shadow.copy_(flat[lo:hi])
        self.ema.updates = int(state["updates"])


def make_ema(trainer) -> NoEMA:
    """The trainer's EMA: a BucketEMA when train.objective=flow and flow.ema_decay > 0."""
    cfg = trainer.cfg
    if cfg.train.objective != "flow" or cfg.flow.ema_decay <= 0:
        return NoEMA()
    return BucketEMA(trainer.dp, trainer.mesh, cfg.flow.ema_decay)
