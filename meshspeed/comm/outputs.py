"""Outputs written whole or not at all, and never over what meshspeed did not write.

Here, below every layer that writes files (checkpoint/, data/, interop/), which may import only
comm/.

Every output outside a checkpoint's step directory (a Hugging Face export, a safetensors export,
a prepared token file) is written under a temporary sibling
`<target>.meshspeed-tmp-<host>-<pid>-<nonce>` and renamed into place once complete, so a crash,
a SIGTERM or a full disk leaves the previous output as it was. The name says who was writing:
the next write of the same target removes what a dead writer left (one line saying so), refuses
while a live one is still at it, and puts back a previous output that an interruption caught
between its two renames (`<target>.meshspeed-old-...`).

A directory meshspeed writes holds `.meshspeed-output.json`, the list of every file it wrote
there (with size and SHA-256). That list is what "meshspeed's own" means: a target holding any
other file is refused unless the caller allows it (`--overwrite`), and even then only the
listed files are ever removed, and a file meshspeed did not write is never replaced.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys

from meshspeed.comm.errors import ConfigError

OUTPUT_MANIFEST = ".meshspeed-output.json"
FORMAT = "meshspeed-output/1"
_SIBLING_RE = re.compile(
    r"^(?P<base>.+)\.meshspeed-(?P<kind>tmp|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<nonce>[0-9a-f]+)$"
)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# What each platform calls a full filesystem, and torch's own words for a short write.
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_SHORT_WRITE = ("unexpected pos", "no space left", "file write failed")


class OutputError(ConfigError):
    """An output cannot be written where asked without losing something; one line says why."""


def say(line: str) -> None:
    print(f"meshspeed: {line}", file=sys.stderr, flush=True)


def host_tag() -> str:
    """Eight hex digits naming this machine, for temporary names on shared filesystems."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def sibling(target: str, kind: str = "tmp", *, host: str | None = None, pid: int | None = None, nonce=None):
    """`<target>.meshspeed-<kind>-<host>-<pid>-<nonce>`: this process's by default."""
    target = os.path.normpath(target)
    nonce = nonce if nonce is not None else secrets.token_hex(4)
    return f"{target}.meshspeed-{kind}-{host or host_tag()}-{pid or os.getpid()}-{nonce}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def clean_orphans(target: str) -> None:
    """Deal with what interrupted writes of `target` left beside it: remove a dead writer's
    temporary output, put back a previous output caught between two renames (each with a line
    saying so), and refuse while a live process is writing the same target."""
    target = os.path.normpath(target)
    parent, base = os.path.dirname(target) or ".", os.path.basename(target)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    here = host_tag()
    for name in sorted(names, key=lambda n: "tmp" in n):  # an old output back before tmp goes
        m = _SIBLING_RE.match(name)
        if not m or m["base"] != base or m["host"] != here:  # another machine's: cannot tell
            continue
        pid, path = int(m["pid"]), os.path.join(parent, name)
        if pid != os.getpid() and _alive(pid):
            raise OutputError(
                f"{target} is being written by another process (pid {pid}, {path}); wait for it to "
                f"finish or choose another path"
            )
        if m["kind"] == "old" and not os.path.lexists(target):
            os.rename(path, target)
            say(f"restored {target} from {name}, left by an interrupted write (pid {pid})")
        elif m["kind"] == "old":
            remove_listed(path)
            say(f"removed {name}, the previous {base} an interrupted write (pid {pid}) left behind")
        else:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
            say(f"removed {name}, left by an interrupted write of {target} (pid {pid})")


def disk_error(err: BaseException, path: str) -> OutputError | None:
    """A full filesystem said as such (torch reports one as 'unexpected pos 704 vs 598'), or None."""
    text = str(err).lower()
    if getattr(err, "errno", None) not in _FULL and not any(w in text for w in _SHORT_WRITE):
        return None
    try:
        free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or '.').free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return OutputError(
        f"no space left on the device writing {path} ({free}); nothing was replaced: free some "
        f"space or write somewhere else"
    )


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# -- the output manifest -------------------------------------------------------------------
def read_output_manifest(directory: str) -> dict[str, dict] | None:
    """{file: {"size", "sha256"}} meshspeed wrote in `directory`, or None when it lists none.
    A manifest of the wrong shape is one OutputError line naming it: it is not trusted."""
    path = os.path.join(directory, OUTPUT_MANIFEST)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OutputError(f"{path} is unreadable ({type(e).__name__}); delete it or the directory") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(files, dict):
        raise OutputError(f"{path} is not a {FORMAT} manifest (key 'format' and a 'files' object)")
    for rel, v in files.items():
        if not inside(rel) or "/" in rel:
            raise OutputError(f"{path}: key 'files' names {rel!r}, which is not a file of that directory")
        ok = isinstance(v, dict) and type(v.get("size")) is int and v["size"] >= 0
        if not ok or not _HEX64.match(str(v.get("sha256"))):
            raise OutputError(
                f"{path}: files[{rel!r}] = {v!r}; expected {{'size': bytes ≥ 0, 'sha256': 64 hex digits}}"
            )
    return files


def write_output_manifest(directory: str, files: dict[str, dict]) -> None:
    body = json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}, indent=1).encode()
    tmp = os.path.join(directory, f"{OUTPUT_MANIFEST}.{os.getpid()}.part")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, OUTPUT_MANIFEST))


def describe_files(directory: str, names) -> dict[str, dict]:
    paths = {n: os.path.join(directory, n) for n in names}
    return {n: {"size": os.path.getsize(p), "sha256": sha256_file(p)} for n, p in paths.items()}


def inside(rel: str) -> bool:
    """`rel` is a relative path that stays inside the directory it is relative to."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return False
    return not rel.startswith("/") and ".." not in rel.split("/") and not re.match(r"^[A-Za-z]:", rel)


def foreign(directory: str, listed: dict | None) -> list[str]:
    """Entries of `directory` (recursively, files and links) that meshspeed's manifest does not list."""
    out = []
    for d, dirs, names in os.walk(directory):
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            rel = os.path.relpath(os.path.join(d, n), directory).replace(os.sep, "/")
            if rel != OUTPUT_MANIFEST and rel not in (listed or {}):
                out.append(rel)
    return sorted(out)


def remove_listed(directory: str) -> list[str]:
    """Delete the files `directory`'s manifest lists, then the manifest and the directory if
    nothing else is left; returns what stayed (files meshspeed did not write)."""
    listed = read_output_manifest(directory) or {}
    for rel in listed:
        try:
            os.remove(os.path.join(directory, rel))
        except FileNotFoundError:
            pass
    left = foreign(directory, listed)
    if not left:
        try:
            os.remove(os.path.join(directory, OUTPUT_MANIFEST))
        except FileNotFoundError:
            pass
        shutil.rmtree(directory, ignore_errors=True)  # empty sub-directories only
    return left


# -- directories ---------------------------------------------------------------------------
def check_target_dir(target: str, setting: str, overwrite: bool, writes) -> None:
    """Refuse, in one line, a target directory holding files meshspeed did not write (unless
    `overwrite`), and always one holding such a file under a name the output would take
    (`writes(name)` says which names those are)."""
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target) or os.path.islink(target):
        raise OutputError(f"{setting}={target!r} exists and is not a directory; name a directory to write")
    others = foreign(target, read_output_manifest(target))
    clash = [n for n in others if writes(n)]
    if clash:
        raise OutputError(
            f"{setting}={target!r} holds {clash[0]}, which meshspeed did not write and this output "
            f"would replace; move it away or choose another directory (--overwrite never replaces "
            f"files meshspeed did not write)"
        )
    if others and not overwrite:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise OutputError(
            f"{setting}={target!r} holds {others[0]}{more}, which meshspeed did not write; choose a new "
            f"or empty directory, or add --overwrite (it replaces only the files listed in meshspeed's "
            f"own {OUTPUT_MANIFEST} there, and keeps everything else)"
        )


def commit_dir(staging: str, target: str, names: list[str]) -> None:
    """Put the complete output `staging` (files `names`, flat) in place as `target`.

    No target: one rename. A target holding only meshspeed's files: the two directories swap
    (target aside as `.meshspeed-old-`, staging in, the old one removed), so an interruption
    leaves one whole output or the other, which the next write restores. A target that also
    holds other files (allowed by --overwrite): meshspeed's files are replaced one by one while
    the manifest lists every file of both outputs, so an interruption never leaves a file of
    meshspeed's unlisted; the other files are never touched."""
    new = describe_files(staging, names)
    write_output_manifest(staging, new)
    fsync_dir(staging)
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.lexists(target):
        os.rename(staging, target)
        fsync_dir(parent)
        return
    listed = read_output_manifest(target) or {}
    if not foreign(target, listed):
        m = _SIBLING_RE.match(os.path.basename(staging))
        old = sibling(target, "old", host=m["host"], pid=int(m["pid"]), nonce=m["nonce"])
        os.rename(target, old)
        os.rename(staging, target)
        fsync_dir(parent)
        remove_listed(old)
        return
    write_output_manifest(target, {**listed, **new})  # the journal: both outputs listed
    for n in names:
        os.replace(os.path.join(staging, n), os.path.join(target, n))
    for n in listed:
        if n not in new:
            try:
                os.remove(os.path.join(target, n))
            except FileNotFoundError:
                pass
    write_output_manifest(target, new)
    fsync_dir(target)
    shutil.rmtree(staging, ignore_errors=True)


# -- single files --------------------------------------------------------------------------
def commit_file(staging: str, target: str) -> None:
    """Rename a complete, fsynced temporary file into place."""
    os.replace(staging, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
