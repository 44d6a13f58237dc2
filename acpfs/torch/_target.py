"""Where a path saved through ``acpfs.torch`` goes, and the state of this process behind it.

This module owns:

- the state of this process: backings set by ``configure()``, the mounts whose saves now go
  straight to the backing, the mount points warned about, and what this process saved;
- resolving a path to its acpfs mount point (live, or recorded but no longer mounted) and that
  mount's backing directory, without touching the FUSE mount (:class:`_Target`, ``_resolve``);
- running a call that may hang in a daemon thread (``_in_thread``) and probing whether a
  mount's daemon answers (``_probe``).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal

from .. import mounttable
from .. import userdirs
from ..commands import client

PROBE_TIMEOUT = 5.0          # how long statvfs may take before a mount counts as hung


class NotPersisted(Exception):
    """The mount's daemon is gone and the path is not (completely) in the backing directory."""
    __module__ = "acpfs.torch"     # part of the public API: acpfs.torch.NotPersisted


# -- state of this process ----------------------------------------------------------------------
_lock = threading.Lock()
_overrides: dict[str, str] = {}                 # mount point (real path) -> backing
_fallen: dict[str, str] = {}                    # mount key -> reason: saves go to the backing
_warned: set[str] = set()                       # mount points warned about
_saved: dict[str, tuple[str, int, int]] = {}    # mount-side path -> (route, size, mtime_ns)
_probes: dict[str, threading.Thread] = {}       # mount point -> statvfs probe still running


# -- resolving a path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Target:
    path: str                     # absolute path, symlinks resolved up to the mount point
    kind: Literal["plain", "mounted", "unmounted"]
    mountpoint: str | None = None
    mount_id: str | None = None
    rel: str = ""
    backing: str | None = None    # None for "mounted" until asked for (live status)

    @property
    def key(self) -> str:
        return f"{self.mountpoint}#{self.mount_id}"

    def backing_root(self) -> str:
        b = self.backing or _backing_from_status(self.mountpoint)
        if b is None:
            raise NotPersisted(f"{self.path}: the backing directory of the acpfs mount point "
                               f"{self.mountpoint} is unknown (no mount record, daemon not answering); "
                               f"use acpfs.torch.configure(mountpoint=..., backing=...) or ACPFS_BACKING")
        return b

    def backing_of(self, path: str) -> str:
        """The backing path of ``path`` (this target or a path under it)."""
        rel = os.path.relpath(path, self.mountpoint)
        return self.backing_root() if rel == "." else os.path.join(self.backing_root(), rel)

    def backing_path(self) -> str:
        return self.backing_of(self.path)


def _env_backing(mountpoint: str, mounted: bool) -> str | None:
    env_mnt, env_back = os.environ.get("ACPFS_MOUNTPOINT"), os.environ.get("ACPFS_BACKING")
    if env_back and env_mnt and os.path.realpath(env_mnt) == mountpoint:
        return os.path.realpath(env_back)
    if env_back and not env_mnt and mounted:
        return os.path.realpath(env_back)
    return None


def _known_backing(mountpoint: str, mounted: bool) -> str | None:
    """configure(), then the mount record, then the environment (the status is asked later)."""
    if mountpoint in _overrides:
        return _overrides[mountpoint]
    rec = userdirs.read_mount_record(mountpoint)
    if rec and rec.get("backing"):
        return rec["backing"]
    return _env_backing(mountpoint, mounted)


def _recorded_backing(directory: str) -> str | None:
    """The backing of a directory that is a recorded (or configured) but unmounted mount point."""
    if directory in _overrides:
        return _overrides[directory]
    rec = userdirs.read_mount_record(directory)
    if rec and rec.get("backing") and os.path.isdir(rec["backing"]):
        return rec["backing"]
    return _env_backing(directory, False)


def _resolve(path: str | os.PathLike) -> _Target:
    """Find the acpfs mount (or recorded mount point) holding ``path`` without touching it.

    Symbolic links are followed (like realpath) up to an acpfs mount point; inside a mount the
    rest of the path is taken as written (normalized), so a hung daemon cannot block this.
    """
    mounts = mounttable.acpfs_mount_ids()
    pending = os.path.abspath(os.fspath(path)).split("/")[1:]
    cur = "/"
    hops = 0
    hit: tuple[str, str] | None = None       # (unmounted mount point, its backing)
    while pending:
        comp = pending.pop(0)
        if comp in ("", "."):
            continue
        if comp == "..":
            cur = os.path.dirname(cur)
            continue
        cand = os.path.join(cur, comp)
        if cand in mounts:                      # never lstat inside an acpfs mount
            full = os.path.normpath(os.path.join(cand, *pending)) if pending else cand
            if full == cand or full.startswith(cand + "/"):
                rel = os.path.relpath(full, cand)
                return _Target(full, "mounted", cand, mounts[cand], "" if rel == "." else rel,
                               _known_backing(cand, True))
            pending = full.split("/")[1:]       # '..' leads out of the mount again
            cur = "/"
            continue
        try:
            st = os.lstat(cand)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))
            target = os.readlink(cand)
            if target.startswith("/"):
                cur = "/"
            pending = [c for c in target.split("/") if c] + pending
            continue
        cur = cand
        b = _recorded_backing(cur)
        if b is not None and (cur in _overrides or not os.path.ismount(cur)):
            hit = (cur, b)           # a recorded mount point, now a bare directory
    if hit and (cur == hit[0] or cur.startswith(hit[0] + "/")):
        rel = os.path.relpath(cur, hit[0])
        return _Target(cur, "unmounted", hit[0], None, "" if rel == "." else rel, hit[1])
    return _Target(cur, "plain")


def _backing_from_status(mountpoint: str | None) -> str | None:
    if mountpoint is None:
        return None
    ok, val = _in_thread(lambda: client.read_status(mountpoint), PROBE_TIMEOUT)
    if ok == "done":
        return val.get("backing")
    return None


# -- running things that may hang -----------------------------------------------------------------
def _in_thread(fn: Callable[[], Any], timeout: float | None,
               name: str = "acpfs-torch") -> tuple[str, Any]:
    """Run ``fn`` in a daemon thread: ("done", result), ("error", exception) or ("hung", thread)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = fn()
        except BaseException as e:  # handed to the caller
            box["err"] = e
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return "hung", t
    if "err" in box:
        return "error", box["err"]
    return "done", box.get("ok")


def _probe(mountpoint: str, timeout: float = PROBE_TIMEOUT) -> Literal["live", "dead", "hung"]:
    """Is the daemon of ``mountpoint`` answering? statvfs is never answered from a kernel cache."""
    if mountpoint not in mounttable.acpfs_mount_ids():
        return "dead"
    prev = _probes.get(mountpoint)
    if prev is not None and prev.is_alive():
        return "hung"
    ok, val = _in_thread(lambda: os.statvfs(mountpoint), timeout, "acpfs-torch-probe")
    if ok == "hung":
        _probes[mountpoint] = val
        return "hung"
    if ok == "error":
        return "dead" if isinstance(val, OSError) and val.errno in client.DEAD_ERRNOS else "live"
    return "live"
