"""Huge pages for the memory files: a tmpfs of the cache directory's own.

A loader that maps a cached file (safetensors, ``torch.load(mmap=True)``, ``np.memmap``) is
passed through to its memory file, and touching a mapping costs one page fault per page
the kernel maps at once. On a tmpfs without huge pages (``/dev/shm`` as distributions mount
it; ``shmem_enabled`` governs only the kernel's internal mount) that is 16 pages (the
fault-around), so 16,384 faults for 1 GiB; on a tmpfs mounted with ``huge=within_size`` a
file's full 2 MiB ranges are huge pages and one fault maps each: 512 faults, and the touch
of every page of a 1 GiB mapping took 5.5 ms instead of 75-80 ms on 2 vCPUs (the backing's
own page cache on ext4, with large folios, takes 5.5 ms too). ``within_size`` makes no huge
page past a file's end, so small files take no more RAM than before.

So a cache directory on a tmpfs without huge pages gets a tmpfs of its own
(``prepare``), mounted over it while it holds no file (nothing a dead daemon left is ever
hidden: that directory is used as it is), under an exclusive lock on its parent directory
(two daemons starting on one cache directory never stack two mounts; the second is then
refused by ``process.lock_cache_dir`` as before). Its source is ``acpfs-cache``; it stays
while a daemon's journal needs it (a daemon killed: the next one finds it mounted, files
and all) and goes with the cache directory when everything is persisted (``release``).
Only where mounting is allowed (root, CAP_SYS_ADMIN); ``ACPFS_NO_HUGE_PAGES=1`` leaves the
directory as it is. Its size is that of the tmpfs it covers: a limit the operator set on
that one (a container's small ``/dev/shm``) still holds.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os

from .. import mounttable
from ..config import env_flag, ram_filesystem

log = logging.getLogger(__name__)

SOURCE = "acpfs-cache"
OPTIONS = "mode=0700,huge=within_size"   # and size=: that of the tmpfs it covers
ALLOWED_LEFT = {"lock"}   # what an empty cache directory may still hold (an old daemon's lock)
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2


def huge(cache_dir: str) -> bool:
    """Whether the tmpfs at ``cache_dir`` (or holding it) gives files huge pages."""
    m = mounttable.mount_holding(cache_dir)
    if m is None or m.fstype != "tmpfs":
        return False
    opts = dict(o.partition("=")[::2] for o in m.options.split(","))
    return opts.get("huge", "never") not in ("never", "deny")


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def prepare(cache_dir: str) -> str:
    """Before the cache directory is locked: huge pages for its memory files where they
    can be had (module docstring). What holds, for the status document and the log: "on",
    or "off: " and why."""
    if env_flag("no_huge_pages"):
        return "off: ACPFS_NO_HUGE_PAGES"
    if ram_filesystem(cache_dir) != "tmpfs":
        return "off: the cache directory is not on tmpfs"
    if huge(cache_dir):
        return "on"
    parent = os.open(os.path.dirname(cache_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(parent, fcntl.LOCK_EX)   # one daemon at a time looks and mounts
        if huge(cache_dir):
            return "on"
        left = set(os.listdir(cache_dir)) - ALLOWED_LEFT
        if left:
            return "off: the cache directory holds files of an earlier mount (huge pages from " \
                   "the next mount on)"
        st = os.statvfs(cache_dir)
        options = f"{OPTIONS},size={st.f_blocks * st.f_frsize}"
        try:
            _libc_call("mount", SOURCE.encode(), os.fsencode(cache_dir), b"tmpfs",
                       ctypes.c_ulong(MS_NOSUID | MS_NODEV), options.encode())
        except OSError as e:
            return f"off: cannot mount a tmpfs there ({e.strerror})"
    finally:
        os.close(parent)
    log.info("cache directory %s: a tmpfs of its own with huge pages (%s)", cache_dir, options)
    return "on"


def release(cache_dir: str) -> None:
    """Everything persisted, the cache directory's contents removed: its own tmpfs goes too
    (detached: a file some program still maps keeps its pages until it unmaps them)."""
    m = mounttable.mount_at(cache_dir)
    if m is None or m.source != SOURCE or m.fstype != "tmpfs":
        return
    try:
        _libc_call("umount2", os.fsencode(cache_dir), ctypes.c_int(MNT_DETACH))
        os.rmdir(cache_dir)
    except OSError as e:
        log.warning("cache directory %s: its tmpfs could not be unmounted: %s", cache_dir, e)
