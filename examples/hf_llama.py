"""Fine-tune a tiny `transformers` Llama with your own loop, split by meshspeed.

    meshspeed run --nproc 4 examples/hf_llama.py          # dp 2 × tp 2, sequence parallel
    meshspeed run --nproc 2 examples/hf_llama.py --tp 1   # dp 2 alone

It ends by writing the trained model with save_pretrained to ./hf_llama_out (--save DIR), which
transformers' from_pretrained loads.
"""

import argparse

import torch
import transformers

import meshspeed
from meshspeed import comm

cli = argparse.ArgumentParser()
cli.add_argument("--tp", type=int, default=2)
cli.add_argument("--steps", type=int, default=10)
cli.add_argument("--save", default="hf_llama_out", help="where save_pretrained writes (default hf_llama_out)")
args = cli.parse_args()

ctx = comm.init()
mesh = comm.ParallelDims(dp=ctx.world_size // args.tp, tp=args.tp).build(ctx)
torch.manual_seed(0)  # every rank starts from the same weights
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
)
model = transformers.LlamaForCausalLM(config).float()
model, opt = meshspeed.parallelize(model, mesh, sequence_parallel=args.tp > 1, zero=1, lr=3e-3)

data = torch.Generator().manual_seed(1)  # the same global batches on every rank
dp, rows = model.meshspeed.dp_rank, 8 // model.meshspeed.dp_size
for step in range(args.steps):
    tokens = torch.randint(0, 256, (8, 32), generator=data)[dp * rows : (dp + 1) * rows]
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    norm = meshspeed.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    loss = comm.all_reduce(loss.detach().reshape(1), mesh["dp"], "avg")  # the global batch's
    if ctx.rank == 0:
        print(f"step {step} loss {loss.item():.6f} grad_norm {norm.item():.6f}", flush=True)

state = meshspeed.gather_for_save(model)  # whole tensors on every rank (collective)
if ctx.rank == 0:
    model.save_pretrained(args.save, state_dict=state)  # transformers' from_pretrained loads it
