"""Temporary files that daemons left in a backing directory: found, aged, removed on request.

A daemon only ever removes its own temporary files and those of the dead daemon whose
journal it recovers (backing.py). A daemon whose cache directory is gone (a node that was
rebooted, a cache directory deleted by hand) leaves its ``.acpfs-tmp-<instance>-*`` files
behind for good, hidden from every mount. No daemon can tell whether a stranger instance
belongs to a live daemon on another node, so removing them is the operator's decision,
guarded by age: ``acpfs temps BACKING --older-than 1d --remove`` (docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import time

from ..backing.backing import NODES_DIR, TEMP_PREFIX

INSTANCE = re.compile(re.escape(os.fsdecode(TEMP_PREFIX)) + r"([0-9a-f]{12})-")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclasses.dataclass
class Temp:
    path: str                 # relative to the backing
    instance: str | None      # None: no daemon instance in its name
    is_dir: bool
    size: int                 # bytes (a directory: of the files in it)
    age_s: float              # since its last change


def parse_age(text: str) -> float:
    """'90s', '30m', '6h', '2d' or plain seconds; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"bad age {text!r}: use e.g. 90s, 30m, 6h or 2d")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def scan(backing: str) -> list[Temp]:
    """Every acpfs temporary file or directory under ``backing`` (symlinks never followed;
    temporary directories are not entered but measured)."""
    now = time.time()
    out = []
    for dirpath, dirnames, filenames in os.walk(backing):
        for name in sorted(dirnames + filenames):
            if not name.startswith(os.fsdecode(TEMP_PREFIX)):
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            size, newest = st.st_size, st.st_mtime
            is_dir = stat.S_ISDIR(st.st_mode)
            if is_dir:
                size = 0
                for sub, _, files in os.walk(full):
                    for f in files:
                        try:
                            fst = os.lstat(os.path.join(sub, f))
                        except FileNotFoundError:
                            continue
                        size += fst.st_size
                        newest = max(newest, fst.st_mtime)
            m = INSTANCE.match(name)
            out.append(Temp(os.path.relpath(full, backing), m.group(1) if m else None, is_dir, size,
                            max(0.0, now - newest)))
        dirnames[:] = [d for d in dirnames if not d.startswith(os.fsdecode(TEMP_PREFIX))
                       and d != os.fsdecode(NODES_DIR)]
    return out


def awaiting_recovery(backing: str) -> dict[str, str]:
    """Instances of daemons on this host that died over ``backing`` and whose journal waits
    for the next mount: instance -> cache directory. Their temporary files (staged content
    of files acknowledged before the crash) must stay until that mount recovers them."""
    from ..config import default_cache_dir
    from ..oplog.journal import read_instance
    from ..userdirs import mount_records
    dirs = {default_cache_dir(backing)}
    for r in mount_records():
        if os.path.realpath(r.get("backing", "")) == backing and r.get("cache_dir"):
            dirs.add(r["cache_dir"])
    out = {}
    for d in dirs:
        inst = read_instance(d)
        if inst:
            out[inst] = d
    return out


def remove(backing: str, temp: Temp) -> None:
    """Remove one temporary file or directory (a symlink itself, never what it names)."""
    full = os.path.join(backing, temp.path)
    st = os.lstat(full)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(full)
    else:
        os.unlink(full)
