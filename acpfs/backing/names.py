"""The names acpfs keeps for itself in the backing, and the errors its calls raise.

What it owns: the temporary names (``.acpfs-tmp-<instance>-...``) and how to read an
instance and an inode out of one, the directories acpfs keeps at the backing root
(``.acpfs-recovered``, ``.acpfs-conflicts``, ``.acpfs-nodes``), the errors of a stale
backing (``STALE``), the checks of one name (``check_name``), and the exceptions
``MissingDir`` and ``NotEmpty``. No system calls: the pieces of ``Backing`` make those.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import urllib.parse


TEMP_PREFIX = b".acpfs-tmp-"
# Temporary names: ``.acpfs-tmp-<instance>-<random>``, where <instance> names one daemon
# (``new_instance``: random, new at every start, kept in its journal) and <random> is 16 hex
# digits from the system's CSPRNG. Nobody can predict a name, a daemon can tell its own
# temporary files (and those of the dead daemon it recovers) from anyone else's, and it
# never opens, reuses, renames or deletes another one (contract 9).
# Files written through (too large for the cache) are staged in the daemon's own staging
# directory at the backing root, ``.acpfs-tmp-<instance>-staging``, so that renaming or
# removing their directory on the mount never touches them; the final rename into place is
# still atomic (same filesystem). Their names end in ``-i<inode>`` (recovery matches them to
# files open at a crash).
STAGED = re.compile(re.escape(TEMP_PREFIX) + rb"([0-9a-f]+)-[0-9a-f]+-i(\d+)")
RECOVERED_DIR = b".acpfs-recovered"   # content acpfs could not put in place, kept aside
CONFLICTS_DIR = b".acpfs-conflicts"   # entries of other writers moved out of the way (conflicts.py)
NODES_DIR = b".acpfs-nodes"           # one record per node sharing the backing (peers.py)
IS_ROOT = os.geteuid() == 0
# what a descriptor of a backing that went away and came back (a remounted NFS, SFS or FUSE
# store) answers: the root and every directory must be opened again by path
STALE = frozenset({errno.ENOTCONN, errno.ESTALE, errno.ENODEV})

Comps = list[bytes]


class MissingDir(OSError):
    """A directory on the way to a path is not in the backing (ENOENT): removed or moved
    behind acpfs's back. ``comps[:depth]`` were found; ``comps[depth]`` was not, or
    (``blocked``) something else, not a directory, stands under its name."""

    def __init__(self, comps: Comps, depth: int, blocked: bool = False) -> None:
        where = os.fsdecode(b"/".join(comps[:depth + 1]))
        why = "is not a directory in" if blocked else "is missing from"
        super().__init__(errno.ENOENT, f"directory {where!r} {why} the backing")
        self.comps = comps
        self.depth = depth
        self.blocked = blocked


class NotEmpty(OSError):
    """An rmdir found entries this daemon did not put there (``entries``: their names)."""

    def __init__(self, name: bytes, entries: list[bytes]) -> None:
        super().__init__(errno.ENOTEMPTY, f"directory {os.fsdecode(name)!r} is not empty")
        self.entries = entries


def flat_name(path: str) -> bytes:
    """A path as one file name for ``.acpfs-recovered/<time>-<instance>/`` or
    ``.acpfs-conflicts/...`` ("/" as %2F): within NAME_MAX, with a digest of the whole path
    where it had to be cut."""
    flat = urllib.parse.quote(path, safe="").encode()
    if len(flat) > 200:
        flat = flat[:160] + b"~" + hashlib.sha1(flat).hexdigest()[:16].encode()
    return flat


def is_internal_name(name: bytes) -> bool:
    """A name acpfs keeps for itself, hidden from the mount: temporary files, node records."""
    return name.startswith(TEMP_PREFIX) or name == NODES_DIR


def new_instance() -> str:
    """A fresh daemon identity for temporary names (48 random bits)."""
    return secrets.token_hex(6)


def staging_dir_of(tmpname: bytes) -> bytes:
    """The staging directory that holds the staged file ``tmpname`` (ValueError if that is
    not the name of a staged file)."""
    m = STAGED.fullmatch(tmpname)
    if m is None:
        raise ValueError(f"{tmpname!r} is not the name of a staged file")
    return TEMP_PREFIX + m.group(1) + b"-staging"


def staged_ino(tmpname: bytes) -> int | None:
    """The inode number a staged file's name carries (None for other names)."""
    m = STAGED.fullmatch(tmpname)
    return int(m.group(2)) if m else None


def check_name(name: bytes) -> None:
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise OSError(errno.EINVAL, f"invalid name {name!r}")
