"""Kernel passthrough: whether a mount asks for it, and the calls that use it.

With FUSE passthrough (Linux 6.9+, ``CONFIG_FUSE_PASSTHROUGH``) an open file's reads,
writes, splices and mmaps go from the kernel straight to a *backing file* the daemon
registered, a memory file of the cache (store/filestore.py): the daemon sees none of them. The C
extension (acpfs/fuse/_fastwrite.c) asks for it in the INIT reply, makes the two ioctls on the
session's descriptor, and puts the backing id into the OPEN or CREATE reply that Python
chose it for (``reply``).

The choice is made once, before the mount (``plan``), because it decides the content
store: memory files where passthrough may be granted, the pool everywhere else
(``acpfs mount --passthrough auto``, the default; ``on`` makes a mount that cannot have it
fail, ``off`` keeps every request on the daemon's path). Where the kernel then does not
grant it at INIT (a kernel built without it), memory files are served through the daemon,
correct and slower; ``status`` and the log say so.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from types import ModuleType

PROC_USER_INIT_INO = 0xEFFFFFFD     # the initial user namespace's inode (include/linux/proc_ns.h)
CAP_SYS_ADMIN = 21
OVERLAYFS_MAGIC = 0x794C7630
FUSE_SUPER_MAGIC = 0x65735546


def _fs_type(path: str) -> int | None:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)   # struct statfs is 120 bytes on x86-64
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return struct.unpack_from("l", buf)[0]


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        have = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return have >= (major, minor)


def _admin_in_initial_namespace() -> bool:
    try:
        if os.stat("/proc/self/ns/user").st_ino != PROC_USER_INIT_INO:
            return False
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


def plan(mode: str, cache_dir: str, ext: ModuleType | None) -> tuple[int, str]:
    """(max_stack_depth to ask for, why not): depth 0 means no passthrough, for the reason
    given; 1 for a cache directory on an ordinary filesystem, 2 on overlayfs (a container's
    root), whose files are themselves stacked. ``mode`` is one of ``config.PASSTHROUGH_MODES``; with "on", the
    caller refuses the mount where the depth is 0."""
    if mode == "off":
        return 0, "turned off (--passthrough off)"
    if ext is None:
        return 0, "the C extension acpfs.fuse._fastwrite is not loaded"
    if not _kernel_at_least(6, 9):
        return 0, f"Linux {platform.release()} is older than 6.9"
    if not _admin_in_initial_namespace():
        return 0, "the daemon lacks CAP_SYS_ADMIN in the initial user namespace (not root)"
    fs = _fs_type(cache_dir)
    if fs == FUSE_SUPER_MAGIC:
        return 0, f"the cache directory {cache_dir} is on a FUSE filesystem"
    return (2 if fs == OVERLAYFS_MAGIC else 1), ""


class Kernel:
    """The passthrough calls of the C extension, for ``Handles`` and ``MemFiles``."""

    def __init__(self, ext: ModuleType, why_not: str = "") -> None:
        self.ext = ext
        self.why_not = why_not

    def granted(self) -> bool:
        """The kernel's INIT reply enabled passthrough (known once the mount is live)."""
        return bool(self.ext.passthrough()["granted"])

    def register(self, fd: int) -> int:
        return self.ext.backing_open(fd)

    def unregister(self, backing_id: int) -> None:
        self.ext.backing_close(backing_id)

    def reply(self, backing_id: int) -> None:
        """The OPEN or CREATE reply sent next passes the file through to ``backing_id``."""
        self.ext.reply_backing(backing_id)

    def state(self) -> dict:
        st = self.ext.passthrough()
        return {"on": bool(st["granted"]), "opens": st["opens"],
                "killpriv_v2": bool(st["killpriv_v2"]),
                "why_not": "" if st["granted"] else
                (self.why_not or "the kernel did not grant it at INIT (built without "
                 "CONFIG_FUSE_PASSTHROUGH?)")}
