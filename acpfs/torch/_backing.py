"""The fallback of ``acpfs.torch`` straight into a mount's backing directory.

This module owns what ``acpfs.torch`` does in the backing directory itself when the mount's
daemon is dead, hung or gone: the atomic, fsynced write (``_write_atomic``), the one warning per
mount naming what was lost with a killed daemon (``_warn_once``), the note in the mount's cache
directory that keeps a recovery from replaying an older version over a fallback save
(``_tell_recovery``), and the check of what reached the backing (``_check_backing``).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import torch

from ..oplog import journal
from .. import userdirs
from ._target import NotPersisted, _Target, _lock, _saved, _warned

log = logging.getLogger("acpfs.torch")


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(d: str) -> None:
    """``os.makedirs`` that also fsyncs the parent of every directory it creates."""
    missing = []
    p = d
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for m in reversed(missing):
        try:
            os.mkdir(m)
        except FileExistsError:
            pass
        _fsync_dir(os.path.dirname(m))


def _write_atomic(obj: Any, final: str, kwargs: dict[str, Any], tag: str) -> None:
    """torch.save to a temporary name next to ``final``, fsync, rename, fsync the directory."""
    d, name = os.path.split(final)
    _makedirs_durable(d)
    tmp = os.path.join(d, f".{name}.acpfs-{tag}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f, **kwargs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(d)


def _lost(t: _Target) -> list[str]:
    """Files this process saved through the mount of ``t`` whose version is not in the backing."""
    with _lock:
        mine = [(p, v) for p, v in _saved.items()
                if v[0] == "mount" and p.startswith(t.mountpoint.rstrip("/") + "/")]
    out = []
    for p, (_, size, mtime_ns) in mine:
        try:
            st = os.stat(t.backing_of(p))
        except OSError:
            out.append(p)
            continue
        if st.st_size != size or st.st_mtime_ns // 1000 != mtime_ns // 1000:
            out.append(p)
    return out


def _warn_once(t: _Target, reason: str, dead: bool = False) -> None:
    """One warning per mount point, until a save through it works again."""
    with _lock:
        if t.mountpoint in _warned:
            return
        _warned.add(t.mountpoint or "")
    lost = _lost(t) if dead else []
    log.warning("acpfs.torch: %s: %s; saving directly to the backing directory %s from now on "
                "(atomic and fsynced, without the write-back cache)%s", t.mountpoint, reason,
                t.backing_root(),
                f". LOST with the daemon ({len(lost)} files saved through the mount but not in the "
                f"backing): " + ", ".join(lost[:10]) + (" ..." if len(lost) > 10 else "") if lost else "")



def _tell_recovery(t: _Target) -> None:
    """List the path in the cache directory of the mount, so that a recovery of the dead
    daemon does not replay an older version over this one (``acpfs.daemon.recovery``)."""
    if t.mountpoint is None:
        return
    rec = userdirs.read_mount_record(t.mountpoint)
    if not rec or not rec.get("cache_dir") or not os.path.isdir(rec["cache_dir"]):
        return
    try:
        journal.record_direct_write(rec["cache_dir"], os.path.relpath(t.path, t.mountpoint))
    except OSError as e:
        log.warning("acpfs.torch: cannot note %s in %s (%s): a recovery of the dead daemon may put "
                    "an older version over it", t.path, rec["cache_dir"], e)



def _check_backing(t: _Target) -> bool:
    """The daemon is gone: is ``t`` (and what this process saved under it) in the backing?"""
    bpath = t.backing_path()
    if not os.path.lexists(bpath):
        raise NotPersisted(f"{t.path} is not persisted: the acpfs daemon of {t.mountpoint} is gone "
                           f"and {bpath} does not exist in the backing")
    missing = []
    with _lock:
        mine = [(p, v) for p, v in _saved.items()
                if p == t.path or p.startswith(t.path.rstrip("/") + "/")]
    for p, (route, size, mtime_ns) in mine:
        bp = t.backing_of(p)
        try:
            st = os.stat(bp)
        except OSError:
            missing.append(f"{p} (missing)")
            continue
        if route == "mount" and (st.st_size != size or st.st_mtime_ns // 1000 != mtime_ns // 1000):
            missing.append(f"{p} (the backing has another version)")
    if missing:
        raise NotPersisted(f"{t.path} is not completely persisted: the acpfs daemon of {t.mountpoint} "
                           f"is gone and the backing lacks {len(missing)} saved files: "
                           + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    return True

