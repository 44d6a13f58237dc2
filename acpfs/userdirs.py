"""What belongs to one user alone on a machine shared with others: the runtime directory
(mount records and locks) and the cache directory, and how their files are opened.

The threat (contract 9, docs/semantics.md "Other users of the machine"): another user creates,
before this one, a directory this user will use in a place everyone may write (``/tmp``,
``/dev/shm``), or plants symbolic links on the way, to read this user's records, make this
user's processes truncate or overwrite files, hold a lock, or redirect checkpoints.

Invariants kept here:

- Every directory on the way to one of ours, and every symbolic link followed on the way, is
  owned by root or by this user, and no other user can change a directory on the way
  (writable by group or others only with the sticky bit, as ``/tmp``: then nobody else can
  rename or remove what this user made in it). Checked by ``secure_dir`` after creating what
  is missing, so a directory someone else made in between is seen.
- Our directory itself is this user's, not a symbolic link, and writable by nobody else (a
  directory others could write may hold a planted journal or record); it is made 0700.
- Files in the runtime directory are opened without following symbolic links, created
  exclusively where they are replaced, and a mount record is believed only if this user
  owns it (``read_mount_record``).

A check that fails raises ``UnsafePath``: one line naming the path, its owner and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat

from .errors import Failure
from .config import key_of

log = logging.getLogger(__name__)
MAX_LINKS = 40
_warned: set[str] = set()      # runtime directories already said to be ignored


def _ignore(d: str, e: Exception) -> None:
    if d not in _warned:
        _warned.add(d)
        log.warning("ignoring mount records in %s: %s", d, e)


class UnsafePath(Failure):
    """A directory or file another user could own or change, refused."""


def owner_name(uid: int) -> str:
    """"user NAME (uid N)", or "uid N" for a uid with no name, for messages."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def secure_dir(path: str, what: str) -> str:
    """Make ``path`` (absolute) a directory of this user alone, creating what is missing
    (mode 0700), and check the whole way to it (module docstring). Returns ``path``."""
    parts = [p for p in path.split("/") if p]
    cur, links = "/", 0
    while parts:
        comp = parts.pop(0)
        if comp == ".":
            continue
        if comp == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, comp)
        last = not parts
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            try:
                os.mkdir(nxt, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            if last:
                raise UnsafePath(f"{what} {path} is a symbolic link: give the directory itself")
            if not _trusted(st):
                raise UnsafePath(f"{what} {path} is reached through the symbolic link {nxt} of "
                                 f"{owner_name(st.st_uid)}: use a path that other users cannot change")
            links += 1
            if links > MAX_LINKS:
                raise UnsafePath(f"{what} {path}: too many levels of symbolic links")
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            parts = [p for p in target.split("/") if p] + parts
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{what} {path}: {nxt} is not a directory")
        if last:
            if st.st_uid != os.geteuid():
                raise UnsafePath(f"{what} {path} belongs to {owner_name(st.st_uid)}, not to you: "
                                 f"another user may have made it first; use another path")
            if st.st_mode & 0o022:
                raise UnsafePath(f"{what} {path} can be written by other users (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): remove it, or use another path")
            if st.st_mode & 0o077:
                fd = os.open(nxt, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fchmod(fd, 0o700)
                finally:
                    os.close(fd)
        else:
            if not _trusted(st):
                raise UnsafePath(f"{what} {path} lies in {nxt}, which belongs to "
                                 f"{owner_name(st.st_uid)}: use a path that other users cannot change")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise UnsafePath(f"{what} {path} lies in {nxt}, which other users can change "
                                 f"(mode {stat.S_IMODE(st.st_mode):04o}): use another path")
        cur = nxt
    return path


# -- the runtime directory ---------------------------------------------------------------
def _candidates() -> list[tuple[str, str]]:
    """Where this user's runtime directory may be, first the one used for writing."""
    if os.geteuid() == 0:
        return [("/run/acpfs", "runtime directory")]
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        out.append((os.path.join(xdg, "acpfs"), "runtime directory (in XDG_RUNTIME_DIR)"))
    out.append((f"/tmp/acpfs-{os.getuid()}", "runtime directory"))
    return out


def runtime_dir() -> str:
    """Mount records and locks of this user's mounts: ``/run/acpfs`` for root, else
    ``$XDG_RUNTIME_DIR/acpfs`` where the session has one (systemd-logind: ``/run/user/UID``),
    else ``/tmp/acpfs-UID``; checked (``secure_dir``) at every use."""
    path, what = _candidates()[0]
    return secure_dir(path, what)


def open_private(name: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """A file of the runtime directory (a lock): never through a symbolic link."""
    return os.open(os.path.join(runtime_dir(), name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def mount_record_name(mountpoint: str) -> str:
    return f"mount-{key_of(mountpoint)}.json"


def write_mount_record(mountpoint: str, record: dict) -> None:
    """Where a mount's backing and cache live, kept after the daemon exits or dies so that
    ``acpfs.torch`` can fall back to the backing and a new mount can find the old cache.
    Written to a new file (created exclusively) renamed over the old one."""
    d = runtime_dir()
    path = os.path.join(d, mount_record_name(mountpoint))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)          # left by a daemon of the same pid that died
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _read_record(path: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            log.warning("ignoring the mount record %s: it belongs to %s", path, owner_name(st.st_uid))
            return None
        try:
            rec = json.load(f)
        except ValueError:
            return None
    return rec if isinstance(rec, dict) else None


def read_mount_record(mountpoint: str) -> dict | None:
    """The record of the last daemon of this user that served ``mountpoint`` (an absolute,
    real path), from a runtime directory that passes the checks; None if there is none."""
    for d, what in _candidates():
        try:
            if not os.path.lexists(d):
                continue
            secure_dir(d, what)
        except (UnsafePath, OSError) as e:
            _ignore(d, e)
            continue
        rec = _read_record(os.path.join(d, mount_record_name(mountpoint)))
        if rec is not None:
            return rec
    return None


def mount_records() -> list[dict]:
    """Every mount record of this user (from the runtime directories that pass the checks)."""
    out = []
    for d, what in _candidates():
        try:
            if not os.path.lexists(d):
                continue
            secure_dir(d, what)
            names = os.listdir(d)
        except (UnsafePath, OSError) as e:
            _ignore(d, e)
            continue
        for n in names:
            if n.startswith("mount-") and n.endswith(".json"):
                rec = _read_record(os.path.join(d, n))
                if rec is not None:
                    out.append(rec)
    return out
