"""``acpfs mount``: the places checked (backing, mount point, cache directory, apart and
free), a stale mount detached, the one ``Options`` built, and the daemon started in the
foreground or forked, with its progress shown until it is ready."""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
from typing import Any

from .. import config, mounttable, userdirs
from ..config import (Options, default_cache_dir, default_cache_size, default_log_file, env,
                      env_flag, format_size, key_of, parse_size, safe)
from ..errors import Failure, UsageError
from ..fuse import passthrough
from ..mounttable import FSTYPE
from . import client
from .progress import Progress


def clean_stale(mountpoint: str) -> None:
    print(f"acpfs: {mountpoint}: the daemon of this mount is gone (transport endpoint not connected); "
          f"detaching the stale mount", file=sys.stderr)
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False, capture_output=True)
    if mounttable.mount_type(mountpoint) is not None:
        subprocess.run(["umount", "-l", mountpoint], check=False, capture_output=True)


def cmd_mount(a: argparse.Namespace) -> int:
    backing, mountpoint, cache_dir = mount_places(a)
    if a.from_command_line:
        from ..fuse.fastwrite import reexec_for_copies
        reexec_for_copies()
    settings = config.settings(a)
    lock = open_lock(f"mount-{key_of(mountpoint)}.lock")
    fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent 'acpfs mount' calls: one at a time
    try:
        if mounted_already(mountpoint, backing):
            return 0
        opts = mount_options(a, backing, mountpoint, cache_dir, settings)
        if opts.foreground:
            return run_foreground(opts, lock)
        return start_daemon(opts, lock)
    finally:
        lock.close()


def mount_places(a: argparse.Namespace) -> tuple[str, str, str]:
    """(backing, mount point, cache directory) of ``acpfs mount``, absolute and checked
    (``check_places``); nothing is created yet."""
    for opt in ("backing", "cache_dir", "cache_size", "log_file", "log_level", "block_size", "fsync"):
        if getattr(a, opt, None) is not None and not getattr(a, opt).strip():
            raise UsageError(f"--{opt.replace('_', '-')} is empty")
    if not os.path.isdir(a.backing):
        raise UsageError(f"backing directory {a.backing} does not exist or is not a directory")
    if not os.path.isdir(a.mountpoint) and not client.is_stale(a.mountpoint):
        raise UsageError(f"mount point {a.mountpoint} does not exist or is not a directory")
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):   # libfuse opens it
        raise UsageError("/dev/fuse is closed to users other than root: it needs mode 0666, as "
                         "udev sets it (some containers leave it 0600)")
    backing = os.path.realpath(a.backing)
    mountpoint = os.path.realpath(a.mountpoint)
    cache_dir = os.path.abspath(a.cache_dir or env("cache_dir") or default_cache_dir(backing))
    check_places(backing, mountpoint, cache_dir)
    return backing, mountpoint, cache_dir


def mounted_already(mountpoint: str, backing: str) -> bool:
    """True when ``mountpoint`` is already this very mount (nothing to do). A stale acpfs
    mount there is detached; another mount, or a mount point holding files, is refused.
    Called holding the mount point's lock."""
    kind = mounttable.mount_type(mountpoint)
    if kind == FSTYPE:
        if client.is_stale(mountpoint):
            clean_stale(mountpoint)
        else:
            st = client.read_status(mountpoint)
            if st["backing"] == backing:
                print(f"acpfs: {mountpoint} is already mounted over {backing} (pid {st['pid']})",
                      file=sys.stderr)
                return True
            raise UsageError(f"{mountpoint} is already an acpfs mount of {st['backing']}")
    elif kind is not None:
        raise UsageError(f"{mountpoint} is already a mount point ({kind})")
    if os.listdir(mountpoint):
        raise UsageError(f"mount point {mountpoint} is not empty")
    return False


def mount_options(a: argparse.Namespace, backing: str, mountpoint: str, cache_dir: str,
                  settings: dict[str, Any]):
    """The daemon's ``Options``, once the backing is free and the cache directory made and
    big enough (``settings``: from ``mount_settings``). Called holding the mount point's
    lock."""
    check_backing_free(backing)
    cache_size_text = a.cache_size or env("cache_size")
    asked = parse_size(cache_size_text, "cache size") if cache_size_text else None
    userdirs.secure_dir(cache_dir, "cache directory")   # not made for a bad --cache-size
    cache_size = asked if asked is not None else default_cache_size(os.path.dirname(cache_dir))
    check_cache_fits(cache_size, os.path.dirname(cache_dir), cache_dir)
    if settings["passthrough"] == "on":
        from ..fuse import fastwrite
        why_not = passthrough.plan("on", cache_dir, fastwrite.extension())[1]
        if why_not:
            raise UsageError(f"--passthrough on: kernel passthrough is not possible here: "
                             f"{why_not} (--passthrough auto mounts without it)")
    block_size = settings["block_size"]
    if cache_size < block_size * 16:
        raise UsageError(f"cache size {cache_size_text} is too small: at least "
                         f"{format_size(block_size * 16)}")
    log_file = a.log_file or env("log_file") or default_log_file(mountpoint)
    return Options(mountpoint=mountpoint, backing=backing, cache_dir=cache_dir,
                   cache_size=cache_size, log_file=log_file,
                   allow_other=a.allow_other or env_flag("allow_other"),
                   noexec=a.noexec or env_flag("noexec"),
                   mlock=a.mlock or env_flag("mlock"), **settings)


def inside(path: str, top: str) -> bool:
    """``path`` is ``top`` or below it (both absolute, real)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def check_places(backing: str, mountpoint: str, cache_dir: str) -> None:
    """Refuse a mount whose directories hold one another, before anything is created: the
    backing, the mount point and the cache directory each apart from the others, the backing
    neither inside nor around acpfs's cache areas in /dev/shm (other mounts' pools and
    journals live there: the mount would serve them, or be taken for one), and neither the
    backing nor the cache directory on an acpfs mount (the daemon would wait on itself)."""
    cache = os.path.realpath(cache_dir)
    places = (("backing directory", backing), ("mount point", mountpoint), ("cache directory", cache))
    for what, path in places:
        for other, top in places:
            if what != other and inside(path, top):
                raise UsageError(f"{what} {path} is "
                                 f"{'the same directory as' if path == top else 'inside'} the "
                                 f"{other} {top}")
    mine = os.path.dirname(default_cache_dir(backing))   # /dev/shm/acpfs-UID
    shm = os.path.realpath(os.path.dirname(mine))
    areas = {os.path.join(shm, os.path.basename(mine))}
    try:   # and other users'
        areas.update(os.path.join(shm, n) for n in os.listdir(shm)
                     if n.startswith("acpfs-") and n[6:].isdigit())
    except OSError:
        pass
    for area in sorted(areas):
        if inside(backing, area) or inside(area, backing):
            raise UsageError(f"backing directory {backing} "
                             f"{'is inside' if inside(backing, area) else 'holds'} {area}, "
                             f"where acpfs keeps the cache directories of mounts (their pools "
                             f"and journals): use a directory elsewhere")
    for m in mounttable.acpfs_mounts():
        for what, path in (("backing directory", backing), ("cache directory", cache)):
            if inside(path, m):
                raise UsageError(f"{what} {path} is on the acpfs mount {m}")


def check_cache_fits(size: int, where: str, cache_dir: str) -> None:
    from ..config import total_ram
    ram = total_ram()
    if size > ram * 0.9:
        raise UsageError(f"cache size {format_size(size)} is more than 90% of RAM ({format_size(ram)})")
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    try:   # a pool left by a previous daemon is reused (and holds what it left to recover)
        free += os.stat(os.path.join(cache_dir, "pool")).st_blocks * 512
    except OSError:
        pass
    if size > free:
        raise UsageError(f"cache size {format_size(size)} does not fit in {where} "
                         f"({format_size(free)} free)")


def open_lock(name: str):
    return os.fdopen(userdirs.open_private(name), "a+")


def check_backing_free(backing: str) -> None:
    with open_lock(f"backing-{key_of(backing)}.lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            where = f.read().strip()
            raise UsageError(f"backing directory {backing} is already mounted"
                             + (f" at {where}" if where else "")) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def run_foreground(opts, lock) -> int:
    from ..daemon import daemon
    lock.close()

    def notify(msg: str) -> None:
        if msg.startswith("progress "):
            print(f"acpfs: {msg[9:]}", file=sys.stderr)
        elif msg.startswith("store "):
            print(f"acpfs: content store: {safe(msg[6:])}", file=sys.stderr)
    try:
        return daemon.run(opts, notify)
    except (RuntimeError, OSError, ValueError) as e:
        raise Failure(f"cannot mount {opts.mountpoint}: {e}") from None


def start_daemon(opts, lock) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        code = 1
        try:
            os.close(r)
            lock.close()
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)

            def notify(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass
            from ..daemon import daemon
            try:
                code = daemon.run(opts, notify)
            except BaseException as e:
                import logging
                logging.getLogger("acpfs").exception("mount failed")
                notify(f"error {e}")
        finally:
            os._exit(code)
    os.close(w)
    prog = Progress()
    buf = b""
    warnings = []   # said once the mount is live: a refusal stays one line
    store = ""      # where the content store lives and what bounds its RAM
    with os.fdopen(r, "rb") as pipe:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            if line == "ready":
                prog.done(f"acpfs: mounted {opts.mountpoint} over {opts.backing} "
                          f"(cache {format_size(opts.cache_size)}, log {opts.log_file})")
                if store:
                    print(f"acpfs: content store: {safe(store)}", file=sys.stderr)
                for w in warnings:
                    print(f"acpfs: warning: {safe(w)}", file=sys.stderr)
                return 0
            if line.startswith("progress "):
                prog.update(line[9:])
            elif line.startswith("store "):
                store = line[6:]
            elif line.startswith("warning "):
                warnings.append(line[8:])
            elif line.startswith("error "):
                buf = line[6:].encode()
    prog.done()
    os.waitpid(pid, 0)
    raise Failure(f"cannot mount {opts.mountpoint}: {buf.decode() or 'the daemon exited'} "
                  f"(log: {opts.log_file})")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own child in tests) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
