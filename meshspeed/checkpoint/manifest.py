"""Checkpoint manifests: every file a save wrote, with its size and SHA-256, written last.

    step-000100/MANIFEST.json   {"format": "meshspeed-manifest/1", "step": 100,
                                 "files": {"__0_0.distcp": {"size": 123, "sha256": "..."}, ...}}

Saving: each rank hashes the files it wrote itself (its DCP shard, its RNG state) while they
are still in the page cache and leaves a partial list under `manifest-parts/`; rank 0 merges
them, hashes what nobody claimed (DCP's `.metadata`, state.pt, meta.json, COMPLETE), and
writes MANIFEST.json as the save's last file, before the directory is renamed into place.

Verifying (resume): every rank reads the manifest and checks that every listed file exists
with its size (a stat: catches truncation and missing shards at once), and hashes its share of
the files (file i on rank i mod world), so a flipped byte anywhere is found while each byte is
read once. The ranks agree on the outcome, so they all take the same decision.

No holes: the manifest must list every file loading will read — the checkpoint's own files and
every file DCP's `.metadata` points tensor data at — and every such path must stay inside the
checkpoint directory (no `..`, no absolute path, no symbolic link leading out). A manifest
listing nothing, or missing one of them, does not verify.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch

from meshspeed import comm

MANIFEST = "MANIFEST.json"
FORMAT = "meshspeed-manifest/1"
PARTS = "manifest-parts"
_CHUNK = 1 << 20

# Why a checkpoint does not verify, as a code the ranks can all-gather.
_OK, _NO_MANIFEST, _MISSING, _SIZE, _HASH, _HOLE = 0, 1, 2, 3, 4, 5
# What every checkpoint's loading reads besides DCP's data files and the RNG states.
REQUIRED = (".metadata", "state.pt", "meta.json", "COMPLETE")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry(root: str, rel: str) -> dict:
    path = os.path.join(root, rel)
    return {"size": os.path.getsize(path), "sha256": sha256_file(path)}


def _walk(root: str) -> list[str]:
    """Every file under `root`, as a relative path with '/' separators, sorted."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            out.append(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/"))
    return sorted(out)


def own_files(root: str, rank: int) -> list[str]:
    """The files rank `rank` wrote in a checkpoint being saved: its DCP shards and RNG state."""
    return [
        rel
        for rel in _walk(root)
        if (rel.startswith(f"__{rank}_") and rel.endswith(".distcp")) or rel == f"rng/rank-{rank:05d}.pt"
    ]


def write_part(root: str, rank: int) -> None:
    """This rank's share of the manifest: the files it wrote, hashed."""
    part = {rel: _entry(root, rel) for rel in own_files(root, rank)}
    os.makedirs(os.path.join(root, PARTS), exist_ok=True)
    with open(os.path.join(root, PARTS, f"rank-{rank:05d}.json"), "w") as f:
        json.dump(part, f)


def write_manifest(root: str, step: int) -> None:
    """Rank 0, after every rank wrote its part: merge, hash the rest, write MANIFEST.json last."""
    files: dict[str, dict] = {}
    parts_dir = os.path.join(root, PARTS)
    if os.path.isdir(parts_dir):
        for name in sorted(os.listdir(parts_dir)):
            with open(os.path.join(parts_dir, name)) as f:
                files.update(json.load(f))
        for name in os.listdir(parts_dir):
            os.remove(os.path.join(parts_dir, name))
        os.rmdir(parts_dir)
    for rel in _walk(root):
        if rel not in files and rel != MANIFEST:
            files[rel] = _entry(root, rel)
    body = json.dumps({"format": FORMAT, "step": int(step), "files": dict(sorted(files.items()))}, indent=1)
    path = os.path.join(root, MANIFEST)
    with open(path, "wb") as f:
        f.write(body.encode())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: str) -> dict[str, dict]:
    """The manifest's file table; raises ValueError saying what is wrong with it (the key, the
    value and what is valid): a manifest is read, not believed."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError(f"it has no {MANIFEST} (saved by an older meshspeed, or not by meshspeed)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"its {MANIFEST} holds a JSON {type(data).__name__}, not a {FORMAT} object")
    files = data.get("files")
    if data.get("format") != FORMAT or not isinstance(files, dict):
        raise ValueError(f"its {MANIFEST} is not a {FORMAT} manifest (format={data.get('format')!r})")
    if not files:
        raise ValueError(f"its {MANIFEST} lists no files, so it vouches for nothing")
    for rel, v in files.items():
        if not inside(root, rel):
            raise ValueError(f"its {MANIFEST} names {rel!r}, outside the checkpoint")
        ok = isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
        if not ok or not _HEX64.match(str(v.get("sha256"))):
            raise ValueError(
                f"its {MANIFEST} has files[{rel!r}] = {str(v)[:80]}; expected "
                f"{{'size': bytes ≥ 0, 'sha256': 64 lowercase hex digits}}"
            )
    return files


def inside(root: str, rel) -> bool:
    """`rel` names a path inside `root`: relative, no `..`, and no link leading out of it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith(("/", "\\")):
        return False
    if ".." in re.split(r"[/\\]", rel):
        return False
    real, top = os.path.realpath(os.path.join(root, rel)), os.path.realpath(root)
    return os.path.commonpath([real, top]) == top


def referenced(root: str) -> list[str]:
    """Every file loading this checkpoint reads: its own files, the RNG state of each rank of
    the world that saved it (meta.json), and every file DCP's `.metadata` points tensor data
    at (read with the allow-listed unpickler; nothing in it runs)."""
    refs = set(REQUIRED)
    try:
        with open(os.path.join(root, "meta.json"), "rb") as f:
            world = json.loads(f.read()).get("world_size")
        if type(world) is int and 0 < world <= 1 << 20:
            refs |= {f"rng/rank-{r:05d}.pt" for r in range(world)}
    except (OSError, ValueError, AttributeError, RecursionError):
        pass  # meta.json itself is required: its absence is reported as a hole
    # torch's distributed checkpoint takes 3 s to import on 2 CPU cores: only when a checkpoint
    # is read, not for every command that imports this module to plan a run.
    from meshspeed.comm import checkpoint_io

    try:
        md = checkpoint_io.read_metadata(root)
    except (OSError, comm.CommError):
        return sorted(refs)  # .metadata is required: reported as missing or damaged
    storage = getattr(md, "storage_data", None) or {}
    for info in storage.values():
        refs.add(getattr(info, "relative_path", None))
    return sorted(refs, key=str)


def holes(root: str, files: dict) -> str | None:
    """The first file loading would read that the manifest does not vouch for, or None."""
    for rel in referenced(root):
        if not inside(root, rel):
            return f"its .metadata points tensor data at {rel!r}, outside the checkpoint (a crafted file?)"
        if rel not in files:
            return f"its {MANIFEST} does not list {rel}, which loading reads (incomplete or altered?)"
    return None


def listed_files(root: str) -> set[str] | None:
    """The files a checkpoint's manifest lists, or None without a readable one."""
    try:
        return set(read_manifest(root))
    except ValueError:
        return None


def _check(root: str, files: dict, names: list[str], rank: int, world: int | None) -> tuple[int, int]:
    """(code, index into names) of the first problem this rank finds, or (_OK, -1). Sizes of
    every file; hashes of this rank's share (none when `world` is None)."""
    for i, rel in enumerate(names):
        path = os.path.join(root, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            return _MISSING, i
        if size != files[rel]["size"]:
            return _SIZE, i
    for i, rel in enumerate(names):
        mine = world is not None and i % world == rank
        if mine and sha256_file(os.path.join(root, rel)) != files[rel]["sha256"]:
            return _HASH, i
    return _OK, -1


def _reason(code: int, rel: str, files: dict, root: str) -> str:
    if code == _MISSING:
        return f"{rel} is missing"
    if code == _SIZE:
        try:
            have = os.path.getsize(os.path.join(root, rel))
        except OSError:
            have = "?"
        want = files[rel]["size"]
        return f"{rel} has {have} bytes where the manifest lists {want} (truncated or overwritten)"
    return f"{rel} does not match its SHA-256 in the manifest (a damaged or altered file)"


def quick_check(root: str) -> str | None:
    """Manifest present, listing every file loading reads, and every file there with its size
    (no hashing): a cheap check for pruning. None when it passes, else the reason."""
    try:
        files = read_manifest(root)
    except ValueError as e:
        return str(e)
    hole = holes(root, files)
    if hole:
        return hole
    code, i = _check(root, files, sorted(files), 0, None)
    return None if code == _OK else _reason(code, sorted(files)[i], files, root)


def verify(root: str, mesh=None) -> str | None:
    """None if the checkpoint at `root` matches its manifest, else one line saying what does
    not. With a mesh: collective over the world, every rank returns the same answer."""
    try:
        files, err = read_manifest(root), None
        err = holes(root, files)
    except ValueError as e:
        files, err = {}, str(e)
    names = sorted(files)
    rank, world = (mesh.ctx.rank, mesh.ctx.world_size) if mesh is not None else (0, 1)
    code, idx = (_NO_MANIFEST, -1) if err else _check(root, files, names, rank, world)
    if mesh is not None and world > 1:
        mine = torch.tensor([[code, idx]], dtype=torch.int64, device=mesh.ctx.device)
        every = comm.all_gather(mine, mesh["world"]).tolist()
        bad = [(c, i, r) for r, (c, i) in enumerate(every) if c != _OK]
        if not bad:
            return None
        code, idx, who = min(bad, key=lambda b: (b[0] == _NO_MANIFEST, b[2]))
        if code == _NO_MANIFEST and err is None:
            return f"rank {who} could not read its {MANIFEST}"
    elif code == _OK:
        return None
    if code == _NO_MANIFEST:
        return err
    return _reason(code, names[idx], files, root)
