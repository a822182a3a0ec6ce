"""A `save_pretrained` directory's safetensors files, and the lazy parameter handle that reads
only a rank's window of one tensor. Apart from hf_import.py so the importers of other kinds of
directories (diffusers_io.py) share them without importing it (hf_import dispatches to them).
"""

from __future__ import annotations

import os

import torch

from meshspeed.checkpoint.safetensors_io import open_safetensors, read_safetensors_header
from meshspeed.comm.errors import ConfigError
from meshspeed.interop.hf_config import read_index
from meshspeed.models.hf import HFTensor, interleaved_rows

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


class SafetensorsFiles:
    """A `save_pretrained` directory's safetensors: per tensor name the file holding it (the
    single file wins over an index, transformers' order), and windowed reads of one tensor.
    SINGLE / INDEX: the file names (diffusers writes diffusion_pytorch_model.* instead)."""

    SINGLE, INDEX = SINGLE, INDEX

    def __init__(self, path: str, setting: str):
        self.path = path
        self.files = self._weight_map(setting)

    def _weight_map(self, setting: str) -> dict[str, str]:
        what = "give the directory save_pretrained wrote"
        if not os.path.exists(self.path):
            raise ConfigError(f"{setting}={self.path!r} does not exist; {what}")
        if not os.path.isdir(self.path):
            raise ConfigError(
                f"{setting}={self.path!r} is a file, not a directory; {what} (the file's folder)"
            )
        index, single = os.path.join(self.path, self.INDEX), os.path.join(self.path, self.SINGLE)
        if os.path.isfile(single):  # transformers' order: the single file wins over an index
            return {k: single for k in read_safetensors_header(single)}
        if os.path.isfile(index):
            return read_index(index, self.path)
        bins = [n for n in os.listdir(self.path) if n.endswith(".bin") or n.endswith(".pt")]
        hint = (
            f" (it holds {bins[0]}: re-save it with save_pretrained(safe_serialization=True))" if bins else ""
        )
        raise ConfigError(f"{setting}={self.path!r} has neither {self.SINGLE} nor {self.INDEX}{hint}")

    def _open(self, name: str):
        # Opened per use, not kept: the recipe (and so this object) lives as long as training,
        # and a kept handle would keep every shard memory-mapped. A header parse costs little.
        return open_safetensors(self.files[name])

    def shape(self, name: str) -> list[int]:
        with self._open(name) as f:
            return list(f.get_slice(name).get_shape())

    def read(self, name: str, window: list[tuple[int, int]]) -> torch.Tensor:
        """Tensor `name` restricted to [start, stop) per leading dim; only that is read."""
        with self._open(name) as f:
            return f.get_slice(name)[tuple(slice(a, b) for a, b in window)]


class LazyParam:
    """The full value of one meshspeed parameter, as a handle: `shape`, `dim()` and `narrow()`
    (what materialize uses to cut a rank's piece) cost nothing; `.to()` reads the window left
    after narrowing from the files, applies the layout change, and returns a real tensor."""

    def __init__(
        self,
        ckpt: SafetensorsFiles,
        fqn: str,
        source: HFTensor,
        full: torch.Size,
        window: list[tuple[int, int]] | None = None,
    ):
        self.ckpt, self.fqn, self.source, self.full = ckpt, fqn, source, full
        self.window = window if window is not None else [(0, n) for n in full]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self.window)

    def dim(self) -> int:
        return len(self.full)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def narrow(self, dim: int, start: int, length: int) -> LazyParam:
        dim %= self.dim()
        a, b = self.window[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"{self.fqn}: narrow({dim}, {start}, {length}) is outside {list(self.shape)}")
        window = list(self.window)
        window[dim] = (a + start, a + start + length)
        return LazyParam(self.ckpt, self.fqn, self.source, self.full, window)

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.read().to(*args, **kwargs)

    def read(self) -> torch.Tensor:
        if self.source.stacked:  # experts: dim 0 picks HF tensors, the rest is a window in each
            (a, b), rest = self.window[0], self.window[1:]
            parts = [self._one(self.source.names[e], rest) for e in range(a, b)]
            return torch.stack(parts) if parts else torch.empty(self.shape)
        return _own(self._one(self.source.names[0], self.window))

    def _one(self, name: str, window: list[tuple[int, int]]) -> torch.Tensor:
        if not self.source.head_dim:
            return self.ckpt.read(name, window)
        # Rotary rows: meshspeed rows [a, b) come from HF rows perm[a:b], all inside the heads
        # covering [a, b) (the permutation stays within each head): read that span, then pick.
        (a, b), rest = window[0], window[1:]
        rows = interleaved_rows(self.full[0], self.source.head_dim)[a:b]
        if rows.numel() == 0:
            return self.ckpt.read(name, [(0, 0)] + rest)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return self.ckpt.read(name, [(lo, hi)] + rest)[rows - lo]


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in memory of its own. safetensors' slices are views into a memory-mapped copy of the
    whole tensor (only the touched pages are read); a parameter must not keep that mapping alive
    (nor let a save see the whole storage)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)
