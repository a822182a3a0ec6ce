"""Your own nn.Module (not a Llama) and loop, data parallel with ZeRO-2 through meshspeed.

    meshspeed run --nproc 4 examples/custom_module.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import meshspeed
from meshspeed import comm


class Net(nn.Module):
    """A tiny MLP language model: embedding, residual MLP blocks, a head."""

    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


ctx = comm.init()
mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
torch.manual_seed(0)  # every rank starts from the same weights
model, opt = meshspeed.parallelize(Net(), mesh, zero=2, lr=3e-3)

data = torch.Generator().manual_seed(1)  # the same global batches on every rank
dp, rows = model.meshspeed.dp_rank, 8 // model.meshspeed.dp_size
for step in range(10):
    tokens = torch.randint(0, 64, (8, 33), generator=data)[dp * rows : (dp + 1) * rows]
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = comm.all_reduce(loss.detach().reshape(1), mesh["dp"], "avg")  # the global batch's
    if ctx.rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
