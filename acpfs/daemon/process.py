"""What a daemon does as a process on its host, apart from serving the mount: its log
(``setup_logging``), the locks that keep one daemon per backing and per cache directory,
the mount's read-ahead, the watch for copies of the mount in other mount namespaces
(``watch_detached``), the drain under SIGTERM/SIGINT (``drain``), and what bounds the RAM
of the content store where the cache directory is (``store_place``)."""

from __future__ import annotations

import fcntl
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from .. import mounttable
from ..config import Options, format_size, ram_filesystem
from ..userdirs import open_private
from .sdnotify import STATUS_EVERY

if TYPE_CHECKING:
    from ..flusher.flusher import Flusher

log = logging.getLogger("acpfs")


def setup_logging(opts: Options) -> None:
    handlers: list[logging.Handler] = []
    if opts.log_file != "-":
        os.makedirs(os.path.dirname(opts.log_file), exist_ok=True)
        # private (it names files), never through a symlink, appended to (logrotate's
        # copytruncate works); one of ours made 0644 by an earlier version becomes 0600
        fd = os.open(opts.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC |
                     os.O_NOFOLLOW, 0o600)
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
        handlers.append(logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8")))
    if opts.foreground or opts.log_file == "-":
        handlers.append(logging.StreamHandler(sys.stderr))
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    root = logging.getLogger()
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(opts.log_level.upper())


def lock_backing(backing: str, mountpoint: str) -> int:
    """Hold a lock on the backing directory for the daemon's lifetime (one mount per backing)."""
    from ..config import key_of
    fd = open_private(f"backing-{key_of(backing)}.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise RuntimeError(f"backing directory {backing} is already mounted"
                           + (f" at {other}" if other else ""))
    os.ftruncate(fd, 0)
    os.pwrite(fd, mountpoint.encode(), 0)
    return fd


def lock_cache_dir(cache_dir: str) -> int:
    """Hold the cache directory for this daemon's life: a second daemon given the same one
    (another mount, another backing) would take the live journal for a dead daemon's and
    replay it into its own backing. Refused with one line instead."""
    fd = os.open(os.path.join(cache_dir, "lock"),
                 os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"cache directory {cache_dir} is in use by another live acpfs daemon: "
                         "give this mount a --cache-dir of its own") from None
    return fd


READ_AHEAD_KB = 1024   # measured: torch.load of a cached 1 GiB file 1.18 -> 1.43 GB/s (128 -> 1024)


def own_dev(mountpoint: str) -> str | None:
    """The device ("major:minor") of this daemon's mount, from /proc/self/mountinfo: a stat of
    the mount point would ask this very daemon, which may not serve requests yet."""
    from .. import mounttable
    dev = None
    for m in mounttable.table():
        if m.mountpoint == mountpoint and m.fstype == mounttable.FSTYPE:
            dev = m.dev
    return dev


async def watch_detached(mountpoint: str) -> None:
    """Say so when the mount was unmounted here but the kernel keeps the filesystem alive,
    because other mount namespaces hold copies of it: the daemon serves them (and does not
    drain and exit) until they let go, which an operator would otherwise not see."""
    import trio

    from .. import mounttable
    await trio.sleep(0.5)
    dev = own_dev(mountpoint)
    if dev is None:
        return
    said = -math.inf
    while True:
        await trio.sleep(1.0)
        if any(m.dev == dev for m in mounttable.table()):
            continue
        holders = await trio.to_thread.run_sync(mounttable.holders_elsewhere, dev)
        if holders and time.monotonic() - said > 60:
            said = time.monotonic()
            log.warning("%s was unmounted here, but %d other mount namespace(s) still hold it (%s): "
                        "serving them until they let go; unmount it there or end those processes, "
                        "then this daemon persists what is left and exits", mountpoint, len(holders),
                        ", ".join(f"pid {pid} {comm} at {where}" for pid, comm, where in holders))


def remove_leftover(path: str) -> None:
    """The other content store's file or directory, left by an earlier mount: its memory
    goes back (a recovery that needs it keeps the store it names, ``Daemon.build``)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def set_read_ahead(mountpoint: str) -> None:
    """Larger read-ahead for the mount's backing device info (the kernel's default is 128 KiB)."""
    dev = own_dev(mountpoint)
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as e:   # not root: the default stays
        log.debug("cannot set %s: %s", path, e)


def drain(flusher: Flusher, progress: Callable[[], None] = lambda: None) -> bool:
    """Wait for the flusher to persist everything, calling ``progress`` every STATUS_EVERY
    seconds meanwhile; a second signal aborts."""
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        log.error("got %s during the drain: stopping without persisting the rest",
                  signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pending = len(flusher.oplog.queue)
    if pending:
        log.info("draining: %d operations (%s) to persist", pending, format_size(flusher.oplog.queued_bytes))
    last = told = time.monotonic()
    while not stop.is_set():
        if flusher.stop(drain=True, timeout=0.2):
            return True
        if time.monotonic() - told > STATUS_EVERY:
            told = time.monotonic()
            progress()
        if not flusher.thread.is_alive():
            log.error("the flusher died with %d operations left", len(flusher.oplog.queue))
            return False
        if time.monotonic() - last > 5:
            last = time.monotonic()
            failing = flusher.failing_op()
            log.info("draining: %d operations (%s) left%s", len(flusher.oplog.queue),
                     format_size(flusher.oplog.queued_bytes),
                     f"; failing: {failing.path}: {failing.error}" if failing else "")
    flusher.stop(drain=False, timeout=10)
    return False


def dirty_limit() -> str:
    """The kernel's limit on dirty page-cache pages, as /proc/sys/vm says it."""
    def read(name: str) -> int:
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0
    if read("dirty_bytes"):
        return f"dirty pages at most {format_size(read('dirty_bytes'))}, vm.dirty_bytes"
    ratio = read("dirty_ratio")
    return (f"dirty pages at most {ratio}% of available memory, vm.dirty_ratio" if ratio
            else "the kernel's dirty-page limits")


def store_place(cache_dir: str, kind: str, cache_size: int, huge_pages: str) -> tuple[dict, str]:
    """Where the content store lives and what bounds its RAM: the facts for the status
    document (``filesystem``, ``ram_bounded_by``: "cache size" on a RAM filesystem, "page
    cache" on a disk one; ``huge_pages``: ``hugecache.prepare``'s answer) and the line
    ``acpfs mount`` prints and the log keeps."""
    fs = ram_filesystem(cache_dir) or mounttable.fstype_of(cache_dir) or "an unknown filesystem"
    size = format_size(cache_size)
    if ram_filesystem(cache_dir):
        why = f"RAM bounded by --cache-size ({size})"
        if kind == "memory files":
            why += ("; a writer is passed through only when its size is known from its name "
                    "or its file (docs/semantics.md, section 6)")
        return ({"filesystem": fs, "ram_bounded_by": "cache size", "huge_pages": huge_pages},
                f"{kind} on {fs} in {cache_dir}: {why}; huge pages {huge_pages}")
    return ({"filesystem": fs, "ram_bounded_by": "page cache", "huge_pages": huge_pages},
            f"{kind} on {fs} in {cache_dir}: disk bounded by --cache-size ({size}); RAM bounded "
            f"by the kernel's page cache ({dirty_limit()}; clean pages are reclaimed as needed)")

