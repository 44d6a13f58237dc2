"""One walker for the whole suite: a directory tree (a backing, a mount, a reference) as a
dict of relative path -> what is there, so that two trees compare with ``==``.

Both tiers import it (``from trees import tree``): the mount tier finds it next to its
conftest.py, the unit tier through tests/unit/conftest.py, which puts tests/ on the path
(and nothing else of the mount tier's conftest.py). It needs no mount and no root.

What a test compares is set by parameters, so that each keeps exactly the check it had:

- ``skip(name)``: names left out (and not entered, for directories): by default acpfs's own
  (``.acpfs-*``: temporary files, node records, conflicts, recovered files);
  ``skip_files(name)``, for files and symlinks, defaults to ``skip``. ``NOTHING`` skips
  nothing.
- ``modes``: ``("dir", mode)``, ``("file", mode, content)``, ``("link", target)`` (modes
  as ``oct``); without: ``"dir"``, ``content``, ``("link", target)``.
- ``contents(path, st)``: what a file's content is given as (``read_bytes``, the default;
  ``sha256``; a cached digest; ``None``: not read at all).
- ``dirs=False``: directories are walked but not listed.
- ``links``: a file with several names also gets its link count and its first name in
  walk order (sorted, parents first), so that two trees with the same hard links compare
  equal and two with different ones do not.
- ``vanished_ok``: a file removed between the listing and the read is left out (a watcher
  polling a backing that changes meanwhile); otherwise FileNotFoundError goes up.

Everything else (FIFOs, sockets, devices) counts as a file: no tree a test compares holds
one.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Callable


def acpfs_name(name: str) -> bool:
    """acpfs's own names in a backing: temporary files, node records, conflicts, recovered
    files."""
    return name.startswith(".acpfs-")


def NOTHING(name: str) -> bool:
    return False


def read_bytes(path: Path, st: os.stat_result) -> bytes:
    return path.read_bytes()


def sha256(path: Path, st: os.stat_result) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree(root: Path | str, *, skip: Callable[[str], bool] = acpfs_name,
         skip_files: Callable[[str], bool] | None = None, modes: bool = True,
         contents: Callable[[Path, os.stat_result], object] | None = read_bytes,
         dirs: bool = True, links: bool = False, vanished_ok: bool = False) -> dict[str, object]:
    """``root`` as relative path -> entry; see the module's docstring for the parameters."""
    root = Path(root)
    skip_files = skip if skip_files is None else skip_files
    out: dict[str, object] = {}
    first: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip(d))
        names = set(dirnames) | {f for f in filenames if not skip_files(f)}
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            try:
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode):
                    entry: object = ("link", os.readlink(p))
                elif stat.S_ISDIR(st.st_mode):
                    if not dirs:
                        continue
                    entry = ("dir", oct(stat.S_IMODE(st.st_mode))) if modes else "dir"
                else:
                    data = contents(p, st) if contents is not None else None
                    entry = ("file", oct(stat.S_IMODE(st.st_mode)), data) if modes else data
            except FileNotFoundError:
                if vanished_ok:
                    continue
                raise
            if links and st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                extra = (st.st_nlink, first.setdefault(st.st_ino, rel))
                entry = (entry + extra) if isinstance(entry, tuple) else (entry,) + extra
            out[rel] = entry
    return out
