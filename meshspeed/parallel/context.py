"""Context parallelism: the sequence split over the cp ranks inside attention.

Three implementations of one attention core (q [batch, seq/cp, heads, hd], k/v [batch, seq/cp,
kv_heads, hd] -> [batch, seq/cp, heads, hd]), swapped into the model's `Attention.core`:

- ulysses: an all-to-all turns the sequence shard into a head shard (full sequence, heads/cp),
  plain attention runs, the inverse all-to-all comes back (DeepSpeed-Ulysses). Needs heads % cp.
- ring: each rank keeps its queries and passes key/value blocks around the cp ring with async
  point-to-point hidden behind the block attention; blocks merge by log-sum-exp in float32; the
  backward passes dK/dV around the ring (ring attention / ring-flash-attn). Any head count.
- hybrid: Ulysses inside groups of `cp_ulysses` consecutive cp ranks, ring across them
  (MindSpeed's Ulysses + ring): fewer ring steps, and heads only need to divide cp_ulysses.

Masks are computed from global token positions, so any sequence layout works. Ring and hybrid
use the zigzag layout (cp rank i holds chunks i and 2·cp−1−i of 2·cp): every rank then has the
same causal work. Packed sequences pass document ids; attention stays inside a document.

Full (non-causal) attention — a family whose recipe says `causal=False`, DiT's image tokens —
visits every block of the ring (nothing to skip, so no zigzag: contiguous slices are balanced).
A family whose input is not a token sequence names `cp_tokens` (entry, exit) in its recipe: the
entry's output is cut to this rank's tokens and the exit's gathered whole (apply_context_parallel).
"""

from __future__ import annotations

import fnmatch
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group
from meshspeed.comm.mesh import Mesh
from meshspeed.comm.recipe import get_optional

from .context_comm import RingStats, gather_ints, gather_tokens, heads_to_seq, seq_to_heads
from .ring_blocks import CAUSAL, ring_backward, ring_forward

IMPLS = ("ulysses", "ring", "hybrid")
LAYOUTS = ("contiguous", "zigzag")


def default_layout(impl: str, causal: bool = True) -> str:
    """Ulysses attends over the whole sequence, and full attention gives every ring block the
    same work, so a plain split is balanced; the causal ring needs zigzag."""
    return "contiguous" if impl == "ulysses" or not causal else "zigzag"


def check_cp(
    impl: str, cp: int, n_heads: int, seq_len: int, cp_ulysses: int = 1, causal: bool = True
) -> None:
    """Every layout error as one line, before any worker starts."""
    if impl not in IMPLS:
        raise ConfigError(f"parallel.cp_impl={impl!r} is not one of {', '.join(IMPLS)}")
    ulysses = {"ulysses": cp, "ring": 1, "hybrid": cp_ulysses}[impl]
    if impl == "hybrid" and (cp_ulysses < 1 or cp % cp_ulysses):
        divs = [d for d in range(1, cp + 1) if cp % d == 0]
        raise ConfigError(f"parallel.cp_ulysses={cp_ulysses} must divide parallel.cp={cp}; valid: {divs}")
    if n_heads % ulysses:
        raise ConfigError(
            f"parallel.cp_impl={impl} splits {n_heads} attention heads over {ulysses} ranks, which does "
            f"not divide; use cp_impl=ring or a Ulysses degree dividing {n_heads}"
        )
    unit = cp if default_layout(impl, causal) == "contiguous" else 2 * cp
    if seq_len % unit:
        raise ConfigError(
            f"sequence length {seq_len} must be a multiple of {unit} for parallel.cp={cp} cp_impl={impl}"
            f"{' (zigzag: 2·cp chunks)' if unit == 2 * cp else ''}; e.g. {seq_len - seq_len % unit or unit}"
        )


def cp_positions(seq_len: int, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Global token positions [seq_len/cp] held by cp rank `rank` (also its RoPE positions)."""
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    if layout != "zigzag":
        raise ConfigError(f"context layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    n = seq_len // (2 * cp)
    far = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange(far * n, (far + 1) * n)])


def shard_sequence(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's rows of a full-sequence tensor (tokens, targets, document ids)."""
    return x.index_select(dim, positions.to(x.device))


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, s, kv, hd] -> [b, s, kv*n_rep, hd], query head h using kv head h // n_rep (the model's
    repeat_kv); autograd sums the copies' gradients back into the kv head."""
    if n_rep == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, n_rep, d).reshape(b, s, kv * n_rep, d)


def kv_replication(n_heads: int, n_kv: int, degree: int) -> int:
    """Fewest copies of each kv head so the kv heads split over `degree` ranks in step with the
    query heads (kv-heads < degree is grouped-query attention at high Ulysses degree)."""
    group = n_heads // n_kv
    for rep in range(1, group + 1):
        if group % rep == 0 and (n_kv * rep) % degree == 0:
            return rep
    raise ConfigError(f"{n_heads} heads cannot be split over a Ulysses degree of {degree}")


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Index ranges where positions increase by one: the causal structure is uniform inside."""
    cut = [0] + ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist() + [len(pos)]
    return list(zip(cut[:-1], cut[1:]))


def _work(pos_q: torch.Tensor, pos_k: torch.Tensor, docs_q, docs_k, causal: bool = True) -> list:
    """Blocks of one (query rank, key rank) pair: (q start, q end, key slice, mask), one per
    (query run, key run). Pairs entirely above the diagonal are skipped; under zigzag the rest
    are fully visible (mask None) or the same chunk (CAUSAL), both the fused kernel's cases.
    Full attention: one block, every key visible (only documents, if packed, still separate)."""
    if not causal:
        same = None if docs_q is None else (docs_q[:, :, None] == docs_k[:, None, :])[:, None, None]
        return [(0, len(pos_q), slice(0, len(pos_k)), same)]
    items = []
    k_runs = _runs(pos_k)
    for a, b in _runs(pos_q):
        pq = pos_q[a:b]
        for c, d in k_runs:
            pk = pos_k[c:d]
            if pk[0] > pq[-1]:
                continue
            mask = None if pk[-1] <= pq[0] else (pk[None, :] <= pq[:, None])[None]  # [1, sq, sk]
            if docs_q is not None:
                same = docs_q[:, a:b, None] == docs_k[:, c:d][:, None, :]  # [b, sq, sk]
                mask = same if mask is None else same & mask
            elif mask is not None and torch.equal(pq, pk):
                mask = CAUSAL
            items.append((a, b, slice(c, d), mask if mask is None or mask is CAUSAL else mask[:, None, None]))
    return items


class _RingAttention(torch.autograd.Function):
    """q [b, g, r, sq, hd], k/v [b, g, sk, hd] float32; works[j]: blocks against ring member j."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, works: list, stats: RingStats | None):
        out, lse = ring_forward(q, k, v, group, works, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.works, ctx.stats = group, works, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(dout, *ctx.saved_tensors, ctx.group, ctx.works, ctx.stats)
        return dq, dk, dv, None, None, None


# The compiled path: the ring as two custom operators that dynamo keeps whole in the graph (their
# point-to-point transfers, block plan and timing are Python it cannot trace). An operator takes
# tensors and numbers, so it names its core by a key; weak, so a dropped core goes with its key.
_CORES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("meshspeed::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cp = _CORES[core]
    return ring_forward(q, k, v, cp.ring, cp.works(q.shape[3]), cp.stats)


@ring_attention_op.register_fake
def _(q, k, v, core):
    return torch.empty_like(q), q.new_empty(q.shape[:-1])


@torch.library.custom_op("meshspeed::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    core: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cp = _CORES[core]
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, cp.ring, cp.works(q.shape[3]), cp.stats)
    return dq, dk, dv.clone()  # an operator's outputs may not share storage (dk, dv: one [2, ...])


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, core):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_op_setup(ctx, inputs, output):
    q, k, v, core = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.core = core


def _ring_op_backward(ctx, dout, _dlse):
    dq, dk, dv = ring_attention_backward_op(dout, *ctx.saved_tensors, ctx.core)
    return dq, dk, dv, None


ring_attention_op.register_autograd(_ring_op_backward, setup_context=_ring_op_setup)


class ContextParallel:
    """The attention core under context parallelism (see the module docstring).

    cp: the cp group; ulysses / ring: its 2-D split (cp member c = ring index · U + Ulysses index).
    """

    ms_traceable = True  # compiles whole: traceable all-to-alls, the ring as custom operators

    def __init__(
        self, impl: str, cp: Group, ulysses: Group, ring: Group, layout: str | None = None, causal=True
    ):
        if ulysses.size * ring.size != cp.size:
            raise ConfigError(
                f"Ulysses degree {ulysses.size} × ring degree {ring.size} must equal cp={cp.size}"
            )
        self.impl, self.cp, self.ulysses, self.ring = impl, cp, ulysses, ring
        self.causal = causal  # the family's recipe.causal: whether blocks above the diagonal skip
        self.layout = layout or default_layout(impl, causal)
        self.stats = RingStats()
        self._cache: dict = {}
        self.key = next(_KEYS)  # names this core to the compiled ring operators
        _CORES[self.key] = self

    def positions(self, seq_len: int, rank: int | None = None) -> torch.Tensor:
        """Global positions of cp rank `rank`'s tokens (default: this rank) for a full length."""
        rank = self.cp.rank if rank is None else rank
        return cp_positions(seq_len, self.cp.size, rank, self.layout)

    def _ring_positions(self, seq_len: int) -> list[torch.Tensor]:
        """Positions after the Ulysses all-to-all: ring member j holds its Ulysses group's tokens."""
        u = self.ulysses.size
        return [
            torch.cat([self.positions(seq_len, j * u + i) for i in range(u)]) for j in range(self.ring.size)
        ]

    def _full_docs(self, doc_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Every cp rank's document ids [b, s/cp] -> the full sequence's [b, seq]."""
        parts = gather_ints(doc_ids, self.cp)  # [cp, b, s/cp]
        full = doc_ids.new_empty(doc_ids.shape[0], seq_len)
        for c in range(self.cp.size):
            full[:, self.positions(seq_len, c).to(full.device)] = parts[c]
        return full

    def __call__(self, q, k, v, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h, _ = q.shape
        seq = s * self.cp.size
        docs = None if doc_ids is None else self._full_docs(doc_ids, seq)
        u = self.ulysses.size
        if u > 1:
            if h % u:
                raise ConfigError(
                    f"{h} attention heads (per tp rank) do not split over a Ulysses degree of {u}"
                )
            rep = kv_replication(h, k.shape[2], u)
            k, v = _expand_kv(k, rep), _expand_kv(v, rep)
            q, k, v = (seq_to_heads(t, self.ulysses) for t in (q, k, v))
        pos = self._ring_positions(seq)
        if self.ring.size == 1:
            # after the all-to-all, a contiguous layout's tokens are in position order
            ordered = self.layout == "contiguous"
            docs0 = None if docs is None else docs[:, pos[0]]
            out = _local_attention(q, k, v, pos[0], docs0, ordered, self.causal)
        else:
            out = self._ring_attention(q, k, v, pos, docs)
        return heads_to_seq(out, self.ulysses) if u > 1 else out

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [B, N/cp, ...] -> every token [B, N, ...] in position order."""
        full = gather_tokens(x, self.cp)  # [B, N, ...], member by member
        if self.layout == "contiguous":
            return full
        order = torch.cat([self.positions(full.shape[1], c) for c in range(self.cp.size)]).argsort()
        return full.index_select(1, order.to(full.device))

    def works(self, sq: int, pos: list[torch.Tensor] | None = None, docs=None) -> list:
        """The ring's block plan for sq query rows per member; it depends only on the layout
        (kept per sq) unless documents are packed."""
        works = self._cache.get(sq) if docs is None else None
        if works is None:
            pos = self._ring_positions(sq * self.ring.size) if pos is None else pos
            me = self.ring.rank
            pick = (lambda j: None) if docs is None else (lambda j: docs[:, pos[j]])  # noqa: E731
            works = [_work(pos[me], pos[j], pick(me), pick(j), self.causal) for j in range(len(pos))]
            if docs is None:
                self._cache[sq] = works
        return works

    def _ring_attention(self, q, k, v, pos: list[torch.Tensor], docs) -> torch.Tensor:
        b, sq, h, d = q.shape
        g = k.shape[2]
        q5 = q.float().view(b, sq, g, h // g, d).permute(0, 2, 3, 1, 4)  # [b, g, r, sq, hd]
        k4, v4 = (t.float().permute(0, 2, 1, 3).contiguous() for t in (k, v))  # [b, g, sk, hd]
        if torch.compiler.is_compiling() and docs is None:
            out = ring_attention_op(q5, k4, v4, self.key)[0]
        else:
            out = _RingAttention.apply(q5, k4, v4, self.ring, self.works(sq, pos, docs), self.stats)
        return out.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)


def _local_attention(
    q, k, v, pos: torch.Tensor, docs, ordered: bool | None = None, causal: bool = True
) -> torch.Tensor:
    """Full-sequence attention after the Ulysses all-to-all; tokens come in layout order, so they
    are put in position order first and SDPA's causal path (or a document mask) applies.
    ordered: whether pos increases (found from pos when None: a host sync). Full attention
    needs no order: each query row sees every key, whatever their order."""
    if not causal:
        ordered = True
    if ordered is None:
        ordered = bool((pos[1:] > pos[:-1]).all())
    if not ordered:
        order = pos.argsort().to(q.device)
        q, k, v = (t.index_select(1, order) for t in (q, k, v))
        docs = None if docs is None else docs.index_select(1, order)
    k, v = _expand_kv(k, q.shape[2] // k.shape[2]), _expand_kv(v, q.shape[2] // v.shape[2])
    mask = None
    if docs is not None:
        n = docs.shape[1]
        mask = (docs[:, :, None] == docs[:, None, :])[:, None]  # [b, 1, seq, seq]
        if causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=docs.device).tril()
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    out = out.transpose(1, 2)
    if not ordered:
        out = out.index_select(1, order.argsort())
    return out


def context_parallel(
    mesh: Mesh, impl: str, cp_ulysses: int = 1, layout: str | None = None, causal: bool = True
) -> ContextParallel:
    """The core for this rank of `mesh` (collective over the world for hybrid: it makes groups).
    causal: the family's recipe.causal (full attention visits every ring block)."""
    cp = mesh["cp"]
    if impl not in IMPLS:
        raise ConfigError(f"parallel.cp_impl={impl!r} is not one of {', '.join(IMPLS)}")
    single = mesh.ctx.single("cp_single")
    if impl == "ulysses":
        return ContextParallel(impl, cp, cp, single, layout, causal)
    if impl == "ring":
        return ContextParallel(impl, cp, single, cp, layout, causal)
    u = cp_ulysses
    if u < 1 or cp.size % u:
        raise ConfigError(f"parallel.cp_ulysses={u} must divide parallel.cp={cp.size}")
    parts = mesh.dims.partitions()["cp"]
    inner = mesh.ctx.split([p[j * u : (j + 1) * u] for p in parts for j in range(len(p) // u)], "cp_ulysses")
    outer = mesh.ctx.split([p[i::u] for p in parts for i in range(u)], "cp_ring")
    return ContextParallel(impl, cp, inner, outer, layout, causal)


def apply_context_parallel(
    model: nn.Module, core, pattern: str = "*attention", tokens: tuple[str, ...] = ()
) -> int:
    """Swap `core` into every module matching `pattern` that has an attention core; returns how many.
    tokens: the recipe's cp_tokens (entry, exit) for a family whose input is not a token sequence
    (split_tokens); empty where the trainer feeds each rank its slice of the tokens."""
    if tokens:
        split_tokens(model, core, *tokens)
    n = 0
    for name, mod in model.named_modules():
        if hasattr(mod, "core") and fnmatch.fnmatch(name, pattern):
            mod.core = core
            n += 1
    if n == 0:
        raise ConfigError(f"context parallelism found no attention core matching {pattern!r} in the model")
    return n


def split_tokens(model: nn.Module, core: ContextParallel, entry: str, exit: str) -> None:
    """This rank's tokens [B, N/cp, ...] (core.positions' rows) are cut from the output of the
    module `entry` [B, N, ...] (an image's patch embedding, fixed positions already added, so
    each token keeps its own), and the output of `exit` [B, N/cp, ...] is gathered whole for what
    follows (unpatchify, the loss). What the blocks take besides (conditioning, text tokens) is
    never cut: it is whole on every rank. A pipeline stage without either module skips it.

    Forward hooks, so FQNs and checkpoints are unchanged. A tensor-parallel wrapper keeps the
    module it wraps as `inner` and splits its output over tp (sequence parallelism): the cp cut
    goes on the wrapped module, before the tp split, so tokens are cut cp-major as the gather
    (tp inside `exit`, then cp here) puts them back."""
    first = get_optional(model, entry)
    while first is not None and hasattr(first, "inner"):
        first = first.inner
    if first is not None:

        def cut(module, args, h):
            if h.shape[1] % core.cp.size:
                raise ConfigError(
                    f"context parallelism over {h.shape[1]} tokens needs parallel.cp={core.cp.size} "
                    "to divide them; choose cp among the divisors"
                )
            return shard_sequence(h, core.positions(h.shape[1]))

        first.register_forward_hook(cut)
    last = get_optional(model, exit)
    if last is not None:
        last.register_forward_hook(lambda module, args, out: core.gather_tokens(out))
