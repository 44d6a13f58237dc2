"""The mount table: one parser of ``/proc/self/mountinfo`` (``table``), the acpfs mounts in
it, the mount holding a path (``mount_of``), and the other mount namespaces that still hold
a mount (``holders_elsewhere``). The daemon and the commands both read it.

Every function takes the table's text as an argument too (``None``: read this process's),
so it can be tested without a mount.
"""

from __future__ import annotations

import dataclasses
import os
import re

from .errors import Failure

FSTYPE = "fuse.acpfs"
MOUNTINFO = "/proc/self/mountinfo"


@dataclasses.dataclass(frozen=True)
class Mount:
    id: str            # the mount ID: new for every mount, even at the same mount point
    mountpoint: str    # unescaped
    fstype: str        # "fuse.acpfs" for an acpfs mount (live or stale)
    dev: str = ""      # "major:minor" of its filesystem: the same in every mount namespace
    source: str = ""   # what was mounted ("acpfs-cache" for a cache directory's own tmpfs)
    options: str = ""  # the filesystem's options ("rw,size=...,huge=within_size")


_ESCAPE = re.compile(r"\\(040|011|012|134)")   # what the kernel escapes: space, tab, newline, \


def unescape(field: str) -> str:
    """A path field of the mount table as the path it names."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/PID/mountinfo`` text, in its order (a later mount on the same
    mount point covers an earlier one). Lines that do not parse are skipped."""
    out = []
    for line in text.split("\n"):
        parts = line.split()
        try:
            sep = parts.index("-", 6)   # after the optional fields
        except ValueError:
            continue
        if len(parts) > sep + 1:
            extra = [unescape(p) for p in parts[sep + 2:sep + 4]]
            out.append(Mount(parts[0], unescape(parts[4]), parts[sep + 1], parts[2], *extra))
    return out


def holders_elsewhere(dev: str) -> list[tuple[int, str, str]]:
    """Other mount namespaces that still hold a mount of the filesystem ``dev``
    ("major:minor"): one (pid, command, mount point) per namespace. A FUSE filesystem lives
    until every copy of its mount is gone, so a daemon whose mount was unmounted here keeps
    serving those (a process started with ``unshare --mount``, a container)."""
    try:
        own = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return []
    seen: set[int] = {own}
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{entry}/ns/mnt").st_ino
            if ns in seen:
                continue
            with open(f"/proc/{entry}/mountinfo", "rb") as f:
                text = os.fsdecode(f.read())
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue   # gone, or not ours to read
        seen.add(ns)
        for m in parse_mountinfo(text):
            if m.dev == dev and m.fstype == FSTYPE:
                out.append((int(entry), comm, m.mountpoint))
                break
    return out


def table(text: str | None = None) -> list[Mount]:
    """The mounts of ``text``, or of this process's mount table."""
    if text is None:
        with open(MOUNTINFO, "rb") as f:
            text = os.fsdecode(f.read())
    return parse_mountinfo(text)


def acpfs_mounts(text: str | None = None) -> list[str]:
    """The mount points of acpfs mounts, live or stale."""
    return [m.mountpoint for m in table(text) if m.fstype == FSTYPE]


def acpfs_mount_ids(text: str | None = None) -> dict[str, str]:
    """acpfs mount points (live or stale) -> their mount ID (new for every mount)."""
    return {m.mountpoint: m.id for m in table(text) if m.fstype == FSTYPE}


def mount_at(path: str, text: str | None = None) -> Mount | None:
    """The mount on mount point ``path`` itself (the last, which covers the others), or None."""
    found = None
    for m in table(text):
        if m.mountpoint == path:
            found = m
    return found


def mount_type(path: str, text: str | None = None) -> str | None:
    """The file system type of the mount whose mount point is ``path``; None if none is."""
    m = mount_at(path, text)
    return None if m is None else m.fstype


def mount_of(path: str, text: str | None = None) -> str:
    """The acpfs mount point holding ``path`` (symlinks resolved; the longest one that holds
    it). Raises Failure when it is on no acpfs mount."""
    best = _holding(path, [m for m in table(text) if m.fstype == FSTYPE])
    if best is None:
        raise Failure(f"{path} is not on an acpfs mount")
    return best.mountpoint


def mount_holding(path: str, text: str | None = None) -> Mount | None:
    """The mount holding ``path``; None when none is found."""
    return _holding(path, table(text))


def _holding(path: str, mounts: list[Mount]) -> Mount | None:
    """Of ``mounts``, the one holding ``path`` (symlinks resolved; the last of the longest
    mount points that hold it, as the kernel resolves it)."""
    real = os.path.realpath(path)
    best = None
    for m in mounts:
        if real == m.mountpoint or real.startswith(m.mountpoint.rstrip("/") + "/"):
            if best is None or len(m.mountpoint) >= len(best.mountpoint):
                best = m
    return best


def fstype_of(path: str, text: str | None = None) -> str:
    """The file system type of the mount holding ``path``; "" when none is found."""
    m = mount_holding(path, text)
    return "" if m is None else m.fstype


# Filesystems on a device of this machine: a metadata call on one (lstat, open) costs
# microseconds from the cache and at worst a disk read; it never waits for a server
LOCAL_FSTYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "tmpfs",
                           "jfs", "reiserfs", "nilfs2", "zfs"})


def local_fstype(path: str, text: str | None = None) -> str | None:
    """The type of the filesystem holding ``path`` where it is local (LOCAL_FSTYPES) and no
    other filesystem is mounted anywhere below ``path``; None otherwise (NFS, Lustre, a FUSE
    filesystem, a mount under it: any of them can make a call wait for a server)."""
    real = os.path.realpath(path)
    if text is None:   # one reading: the type and what lies below it from one moment
        with open(MOUNTINFO, "rb") as f:
            text = os.fsdecode(f.read())
    kind = fstype_of(real, text)
    if kind not in LOCAL_FSTYPES:
        return None
    below = real.rstrip("/") + "/"
    if any(m.mountpoint.startswith(below) for m in table(text)):
        return None
    return kind
