"""`parallelize(model, dims, load_from=DIR)`: the user's model born sharded.

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)       # shapes only, no memory
    model, opt = meshspeed.parallelize(model, mesh, load_from="saved")   # save_pretrained's dir

The order is parallel/materialize.py's: the meta model is split first (tensor parallelism cuts
meta parameters into tagged meta pieces), then each piece is given memory holding its slice of
the tensor of the same name in DIR's safetensors files. The value is a `LazyParam`
(interop/hf_import.py): materialize narrows it to this rank's piece exactly as it narrows a real
tensor, and only that window is read, through safetensors' memory-mapped `get_slice`. So a rank
reads, and ever holds, only its own pieces (plus what stays whole: norms, a row-parallel bias).

Names are the model's own state_dict names, which is what `save_pretrained` writes; a tied alias
absent from the files (a tied `lm_head.weight`) is its owner's tensor. Buffers hold no weights:
a persistent one is read whole from the files; a non-persistent one (RoPE's `inv_freq`) is
recomputed by the `transformers` model's own `_init_weights` on its module. Every name, shape
and buffer is checked before the model is changed, so a refused model is left as it was.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshspeed.checkpoint.safetensors_io import read_safetensors_header
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import Recipe
from meshspeed.interop.hf_import import LazyParam, SafetensorsFiles
from meshspeed.interop.hf_plan import tied_pairs
from meshspeed.models.hf import HFTensor
from meshspeed.parallel.materialize import materialize


class SafetensorsDir(SafetensorsFiles):
    """A `save_pretrained` directory's tensors by name, with every tensor's shape from the
    headers (checked against the meta model before anything is read)."""

    def __init__(self, path: str):
        super().__init__(path, "parallelize: load_from")
        self.shapes, self.dtypes = {}, {}
        for f in sorted(set(self.files.values())):
            for name, entry in read_safetensors_header(f).items():
                if name != "__metadata__":
                    self.shapes[name] = list(entry["shape"])
                    self.dtypes[name] = entry["dtype"]


# safetensors' floating-point dtype codes; a float parameter read from any other would be cast
# (int64 ids, bool masks: silently float32 before)
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


class _Plan:
    """What load_from will read, checked against the meta model before anything changes."""

    def __init__(self, model: nn.Module, path: str):
        self.dir = SafetensorsDir(path)
        aliases: dict[str, list[str]] = {}
        for alias, owner in tied_pairs(model):
            aliases.setdefault(owner, []).append(alias)
        self.source: dict[str, str] = {}  # parameter (owner name) -> tensor name in the files
        for name, p in model.named_parameters():
            found = next((n for n in (name, *aliases.get(name, ())) if n in self.dir.files), None)
            self._check(name, found, list(p.shape), p.dtype)
            self.source[name] = found
        self.recompute: list[nn.Module] = []  # modules whose non-persistent buffers are derived
        self.buffers: dict[str, str] = {}  # persistent meta buffer -> its tensor in the files
        for mod_name, mod in model.named_modules():
            for key, b in mod._buffers.items():
                if b is None or not b.is_meta:
                    continue
                name = f"{mod_name}.{key}" if mod_name else key
                if key not in mod._non_persistent_buffers_set:
                    self._check(name, name if name in self.dir.files else None, list(b.shape), b.dtype)
                    self.buffers[name] = name
                elif hasattr(model, "_init_weights") and not any(True for _ in mod.parameters(recurse=False)):
                    if mod not in self.recompute:
                        self.recompute.append(mod)
                else:
                    raise ConfigError(
                        f"parallelize: load_from: buffer {name!r} of {type(mod).__name__} is not saved "
                        "and nothing here can recompute it on a meta model; build the model on a real "
                        "device and load it whole (from_pretrained), then parallelize without load_from"
                    )

    def _check(self, name: str, found: str | None, shape: list[int], dtype: torch.dtype) -> None:
        if found is None:
            raise ConfigError(
                f"parallelize: load_from={self.dir.path!r} has no tensor {name!r} that the model holds; "
                "give the directory save_pretrained wrote for this model"
            )
        if self.dir.shapes[found] != shape:
            raise ConfigError(
                f"parallelize: load_from: {found} has shape {self.dir.shapes[found]} in "
                f"{self.dir.path!r} but the model's is {shape}; is the config the saved model's?"
            )
        code = self.dir.dtypes[found]
        if dtype.is_floating_point and code not in FLOAT_CODES:
            raise ConfigError(
                f"parallelize: load_from: {found} holds {code} values in {self.dir.path!r} but the "
                f"model's {name} is {dtype}; it is not cast: save the model's own floating-point weights"
            )

    def init(self, fqn: str, shape: torch.Size, seed: int) -> LazyParam:
        """Recipe.init for materialize: a handle on the whole tensor, narrowed there to this
        rank's piece and read only then (the seed is not used)."""
        return LazyParam(self.dir, fqn, HFTensor((self.source[fqn],)), torch.Size(shape))

    @torch.no_grad()
    def finish(self, model: nn.Module) -> None:
        for name, src in self.buffers.items():
            mod_name, _, key = name.rpartition(".")
            buf = model.get_submodule(mod_name).get_buffer(key)
            buf.copy_(self.dir.read(src, [(0, n) for n in buf.shape]))
        for mod in self.recompute:
            model._init_weights(mod)  # transformers': RoPE's inv_freq from the module's config


def check_meta(model: nn.Module, load_from: str | None) -> bool:
    """True when `model` is to be born sharded from `load_from`; one line when the two disagree."""
    params = list(model.named_parameters())
    meta = [n for n, p in params if p.is_meta]
    if meta and load_from is None:
        raise ConfigError(
            f"parallelize: the model was built on the meta device ({meta[0]!r} holds no values); pass "
            "load_from='<the directory save_pretrained wrote>' to read each rank's slices, or build it on "
            "a device"
        )
    if load_from is not None and len(meta) != len(params):
        real = next(n for n, p in params if not p.is_meta)
        raise ConfigError(
            f"parallelize: load_from={load_from!r} fills a model built under torch.device('meta'), but "
            f"{real!r} already holds values; build the model on meta, or drop load_from"
        )
    return load_from is not None


def plan_load(model: nn.Module, load_from: str) -> _Plan:
    """Every check of load_from against the meta model (before parallelize changes it)."""
    return _Plan(model, load_from)


def load_pieces(model: nn.Module, plan: _Plan, recipe: Recipe, mesh) -> None:
    """Materialise the split meta `model` with this rank's pieces read from the files."""
    loading = dataclasses.replace(recipe, init=plan.init, finish=plan.finish)
    materialize(model, loading, mesh, device=mesh.ctx.device)
