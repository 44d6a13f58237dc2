"""The daemon's life: set up the cache, serve the mount, drain, exit.

Shutdown never loses data: however the FUSE loop ends (``acpfs umount``, a plain
``fusermount3 -u``, SIGTERM or SIGINT), the daemon keeps running until the flusher has
persisted everything, logging progress. A second SIGTERM/SIGINT during the drain stops it
at once; what was not persisted stays in the cache directory and the log says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, TypeVar

from ..config import Options, format_size, ram_filesystem
from .metrics_http import Endpoint, Unavailable
from ..cluster.plane import Plane
from ..userdirs import secure_dir, write_mount_record
from ..backing.retry import describe
from .process import (drain, lock_backing, lock_cache_dir, remove_leftover, set_read_ahead,
                      setup_logging, store_place, watch_detached)
from .sdnotify import STATUS_EVERY, Notifier
from .collector import Collector
from . import hugecache

if TYPE_CHECKING:
    from ..cluster.peers import Peers
    from ..core.peerreads import PeerPlane

log = logging.getLogger("acpfs")
T = TypeVar("T")
RECORDS_AT_MOUNT = 5.0   # s the mount waits for the node records before it goes on without


class StorePlan(NamedTuple):
    """The content store a daemon opens (``Daemon._plan_recovery``)."""
    cache_size: int
    block_size: int
    depth: int            # passthrough's stacking depth; 0: off
    why_not: str          # why passthrough is off
    memory_files: bool    # memory files (passthrough's store), else the pool


class Daemon:
    """One daemon's life, in phases: ``build`` (the cache, the flusher, the journal),
    ``recover`` (replay what a dead daemon left), ``serve`` (the FUSE loop), ``drain``
    (persist everything), ``close``. ``run`` strings them together; ``offline.recover_offline``
    does all but ``serve``, with no mount (``headless``: no mount point, no lock on the
    backing, nothing the kernel passes through; ``acpfs recover``)."""

    def __init__(self, opts: Options, notify: Callable[[str], None], systemd: Notifier,
                 headless: bool = False) -> None:
        self.opts = opts
        self.headless = headless
        self.notify = notify   # progress and warning lines for the 'mount' command, then 'ready'
        self.systemd = systemd   # readiness, status and stopping for a Type=notify unit
        self.replay: list = []
        self.dirty: list = []
        self.left = None
        self._last_progress = 0.0
        self.endpoint: Endpoint | None = None   # --metrics, bound first thing (_start)
        self.plane: Plane | None = None         # --peers-listen, bound first thing (_start)
        self.replication: Any = None            # with the plane: replicas (replication.py)
        self._loop = None            # the FUSE loop's trio token, once it runs (serve)
        self._quiet = threading.Lock()   # the drain's last change of the files vs. a scrape

    def build(self) -> None:
        """Logging, locks, the mount record, the pool, and the core wired together."""
        self._start()
        plan = self._plan_recovery()
        self._open_store(plan)
        self._build_parts(plan.why_not)

    def _start(self) -> None:
        """Logging, the metrics endpoint (``--metrics``), the lock on the backing, the mount
        record, the cache directory held."""
        opts = self.opts
        setup_logging(opts)
        if opts.metrics:   # first: a port in use refuses the mount before anything is made
            self.endpoint = Endpoint(opts.metrics, self._metrics_text)
            self.endpoint.start()
        if opts.peers_listen:   # bound now, served once its secret is read (_peer_plane)
            self.plane = Plane(opts.peers_listen, None, None)
        os.umask(0o077)
        # a recovery without a mount takes no lock on the backing: the backing may be
        # mounted on this node meanwhile (one mount per backing; recover_offline)
        self.lock_fd = None if self.headless else lock_backing(opts.backing, opts.mountpoint)
        if not self.headless:
            write_mount_record(opts.mountpoint, {"mountpoint": opts.mountpoint,
                                                 "backing": opts.backing, "cache_dir": opts.cache_dir,
                                                 "log_file": opts.log_file, "pid": os.getpid(),
                                                 "started": time.time()})
        secure_dir(opts.cache_dir, "cache directory")
        self.huge_pages = hugecache.prepare(opts.cache_dir)   # before the lock file is made
        self.cache_lock_fd = lock_cache_dir(opts.cache_dir)
        log.info("starting: mount %s, backing %s, cache %s in %s", opts.mountpoint, opts.backing,
                 format_size(opts.cache_size), opts.cache_dir)
        ram = ram_filesystem(opts.backing)
        if ram:   # allowed (tests, scratch): said once, here and by 'acpfs mount'
            said = (f"backing directory {opts.backing} is on a RAM filesystem ({ram}): nothing "
                    f"in it survives a reboot")
            log.warning("%s", said)
            self.notify(f"warning {said}")

    def _plan_recovery(self) -> StorePlan:
        """What a dead daemon left (``replay``, ``dirty``), and the store this one opens: a
        recovery keeps the store, size and block size the dead daemon's journal names;
        passthrough (``depth``) as the options and the kernel allow."""
        from ..fuse import fastwrite, passthrough
        from ..oplog import journal
        from . import recovery
        from ..store.pool import Pool
        opts = self.opts
        left = self.left = journal.read_leftover(opts.cache_dir)
        self.replay, self.dirty = recovery.plan(left) if left else ([], [])
        cache_size, block_size = opts.cache_size, opts.block_size
        depth, why_not = passthrough.plan(opts.passthrough, opts.cache_dir, fastwrite.extension())
        recovering = bool(self.replay or self.dirty)
        if recovering:
            assert left is not None
            log.warning("recovering: a previous daemon died with %d changes not persisted (%d "
                        "files open for writing); replaying its journal from %s", len(self.replay),
                        len(self.dirty), opts.cache_dir)
            if left.block_size == 0:   # its content is in memory files: served from them
                cache_size = left.pool_size
                if not depth and not self.headless:
                    log.warning("recovering the memory files of a daemon that had passthrough; "
                                "this one serves them without it (%s)", why_not)
            elif (left.pool_size, left.block_size) != (Pool.size_for(cache_size, block_size), block_size):
                log.warning("recovering with the previous cache size %s and block size %s; the "
                            "options given apply from the next mount",
                            format_size(left.pool_size), format_size(left.block_size))
                cache_size, block_size = left.pool_size, left.block_size
            journal.start_recovery(opts.cache_dir)
            self.notify(f"progress recovering {len(self.replay)} changes left by a dead daemon")
        # a recovery keeps the store the dead daemon's journal names
        files = (left.block_size == 0) if recovering else bool(depth)
        if depth and not files:
            depth, why_not = 0, "recovering a journal of the pool (passthrough from the next mount)"
        return StorePlan(cache_size, block_size, depth, why_not, files)

    def _open_store(self, plan: StorePlan) -> None:
        """The kernel's passthrough, if on, and the content store: memory files with it, the
        pool without; the dead daemon's block references claimed."""
        from ..fuse import fastwrite, passthrough
        from ..store import filestore
        from . import recovery
        from ..store.filestore import MemFiles
        from ..store.pool import Pool
        opts = self.opts
        ext = fastwrite.extension()
        self.kernel = passthrough.Kernel(ext, plan.why_not) if ext is not None and plan.depth else None
        if plan.depth:
            fastwrite.ask_passthrough(plan.depth)
        if plan.memory_files:
            remove_leftover(os.path.join(opts.cache_dir, "pool"))
            self.store = MemFiles(opts.cache_dir, plan.cache_size,
                                  unregister=self.kernel.unregister if self.kernel else None)
        else:
            log.info("kernel passthrough off: %s; every read and write goes through the daemon",
                     plan.why_not)
            remove_leftover(os.path.join(opts.cache_dir, filestore.DIRNAME))
            self.store = Pool(os.path.join(opts.cache_dir, "pool"), plan.cache_size, plan.block_size,
                              progress=self._allocating, mlock=opts.mlock)
        self.store.claim_refs(recovery.claimed_content(self.replay))
        self.place, said = store_place(opts.cache_dir, self.store.kind, self.store.limit,
                                       self.huge_pages)
        log.info("content store: %s", said)
        self.notify(f"store {said}")

    def _build_parts(self, why_not: str) -> None:
        """In order, each built whole: the backing, the journal, the op log, global order,
        the cache, the flusher, the mount's information and the core."""
        from ..fuse import attrtable, fastwrite
        from ..oplog import journal
        from ..backing.backing import Backing, new_instance
        from ..cache.cache import Cache
        from ..core.control import MountInfo
        from ..core.requests import Core
        from ..flusher.flusher import Flusher
        from ..fuse.notices import KernelCacheNotices, invalidate_attrs_now
        from ..oplog.log import OpLog
        from ..cluster.globalorder import GlobalOrder
        from ..cluster.peers import Peers
        opts, left = self.opts, self.left
        instance = new_instance()
        predecessor = left.instance if left else None
        # a new identity for this daemon's temporary files; the dead one's leftovers are ours
        self.backing = Backing(opts.backing, instance, predecessor)
        log.info("temporary files of this daemon: %s*", os.fsdecode(self.backing.mine))
        self.base_seq = left.last_seq if left else 0
        # the dead daemon's applied counter stays until its journal is replayed (a crash during
        # the replay must find both as they were)
        self.journal = journal.Journal(opts.cache_dir, self.store.unit, self.store.limit,
                                       self.backing.instance)
        self.oplog = OpLog(self.store, self.journal, applied_seq=self.base_seq)
        self.join_wait = 0.0
        self.peers = Peers(self.backing, instance, opts.mountpoint, skew=opts.max_clock_skew,
                           heartbeat=opts.peer_heartbeat, lease=opts.peer_lease,
                           lock=self.oplog.lock, frontier=self.oplog.frontier) \
            if opts.global_order else None
        # the frontier of the dead daemon this one recovers, if it left a record
        front = self._records(self.peers, lambda: self.peers.find_predecessor(predecessor)) \
            if self.peers is not None else None
        cache = self.cache = Cache(self.oplog, self.backing, self.store, KernelCacheNotices())
        order = GlobalOrder(self.peers, self.oplog) if self.peers is not None else None
        self.flusher = Flusher(self.oplog, cache, self.backing, order, opts.flush_workers,
                               fastwrite.last_request)
        passthrough = self.kernel.state if self.kernel is not None else \
            (lambda: {"on": False, "why_not": why_not})
        self.info = MountInfo(opts, store_place=self.place, fast_write=fastwrite.state,
                              attr_table=attrtable.state, at_once=fastwrite.at_once_state,
                              passthrough=passthrough,
                              metrics=self.endpoint.address if self.endpoint else None)
        self.core = Core(self.flusher, self.info, order=order, kernel=self.kernel,
                         direct_io_mmap=fastwrite.direct_io_mmap,
                         invalidate_attrs=invalidate_attrs_now,
                         peer_plane=self._peer_plane(instance))
        if self.replication is not None and self.replication.sender is not None \
                and opts.replica_wait:
            self.core.replica_wait = self.replication.sender.wait_copied
        if self.peers is not None:
            self._join(self.peers, front, predecessor)

    def _peer_plane(self, instance: str) -> PeerPlane | None:
        """The peer plane's parts (--peers-listen) and replicas (replication.py)."""
        from .replication import peer_plane
        if self.plane is None or self.peers is None:
            return None
        parts, self.replication = peer_plane(self.opts, self.plane, self.peers, instance,
                                             self.oplog, self.store)
        if self.replication is not None:
            self.info.replicas = self.replication.status
        return parts

    def _join(self, peers: Peers, front: float | None, predecessor: str | None) -> None:
        """Write this node's record among the other nodes' (global order, peers.py)."""
        if self.replay or self.dirty:
            # what the dead daemon acknowledged is older than anything: its frontier (or,
            # without its record, the oldest stamp) holds the other nodes back until the
            # replayed changes are in the backing
            self.oplog.recovery_stamp = front if front is not None else 1e-6

        def enter() -> float:
            wait = peers.enter()
            if predecessor is not None:
                peers.forget_predecessor(predecessor)   # this node's record now covers it
            return wait
        self.join_wait = self._records(peers, enter) or 0.0

    def _records(self, peers: Peers, fn: Callable[[], T]) -> T | None:
        """``fn()``, the records' I/O at mount. A backing that refuses the records (read-only,
        a file in the way) or does not answer within RECORDS_AT_MOUNT seconds does not stop
        the mount: changes stay pending as for any failing backing, and the records thread
        keeps trying (status.peers.error); until this node's record is written, the other
        nodes do not know to wait for it."""
        out: list = []

        def run() -> None:
            try:
                out.append(fn())
            except OSError as e:
                out.append(e)
        t = threading.Thread(target=run, name="acpfs-records-at-mount", daemon=True)
        t.start()
        t.join(RECORDS_AT_MOUNT)
        why = ("it does not answer" if not out else describe(out[0])
               if isinstance(out[0], OSError) else None)
        if why is None:
            return out[0]
        peers.error = why
        log.warning("global order: cannot keep this node's record in %s (%s); retrying in the "
                    "background: until it is written, the other nodes do not wait for this one",
                    peers.dir, why)
        return None

    def _allocating(self, done: int, total: int) -> None:
        if time.monotonic() - self._last_progress > 0.5 or done == total:
            self._last_progress = time.monotonic()
            self.notify(f"progress allocating cache {format_size(done)} / {format_size(total)}")

    def recover(self) -> None:
        """Replay a dead daemon's journal into the cache, then start the flusher."""
        from ..oplog import journal
        from . import recovery
        opts = self.opts
        if self.replay or self.dirty:
            assert self.left is not None
            report = recovery.recover(self.cache, self.left, self.replay, self.dirty,
                                      progress=lambda i, n: self.notify(
                                          f"progress recovering: {i} of {n} changes replayed"))
            self.info.recovery = report.as_dict()
            self.info.recovery_aside = report.aside_seqs
            log.warning("recovered: %d files and %d operations queued for persisting again, %d "
                        "already done, %d open files lost, %d kept aside (queued for "
                        ".acpfs-recovered/ in %s)", report.files, report.replayed_ops,
                        report.skipped, len(report.lost_open_files), len(report.kept_aside),
                        opts.backing)
        journal.finish_recovery(opts.cache_dir)        # the new journal holds all that is pending
        with self.oplog.lock:
            self.journal.applied(self.base_seq)
        journal.forget_direct_writes(opts.cache_dir)   # replayed around, or nothing to replay
        self.oplog.recovery_stamp = None               # the replayed ops carry it in the queue
        self.flusher.start()
        if self.peers is not None:
            self.peers.start()
        if self.replication is not None:
            self.replication.start()

    def serve(self) -> None:
        """Mount, answer requests until unmounted or signalled, unmount."""
        from ..fuse import fastwrite  # before pyfuse3: it interposes fuse_session_new
        import pyfuse3
        import trio

        from ..fuse import attrtable
        from ..fuse.atonce import AtOnce
        from ..fuse.operations import BLKSIZE, make_operations

        opts = self.opts
        if self.join_wait:
            self.notify(f"progress joining the other nodes of {opts.backing}")
            time.sleep(self.join_wait)
        ops = make_operations(self.core)
        fuse_opts = set(pyfuse3.default_options)
        fuse_opts |= {"fsname=acpfs", "subtype=acpfs", "default_permissions"}
        if opts.allow_other:
            fuse_opts.add("allow_other")
        if opts.noexec:
            fuse_opts.add("noexec")
        pyfuse3.init(ops, opts.mountpoint, fuse_opts)
        fastwrite.install(ops.write_now, ops.fallocate_now, AtOnce(ops).hooks())
        attrtable.enable(BLKSIZE)
        fastwrite.start_idle_poll(opts.idle_poll)
        self.info.idle_poll = fastwrite.idle_poll_state
        requests = self.info.requests
        collector = Collector(lambda: (sum(requests.values()), fastwrite.last_request()))
        self.info.collector = collector.status
        log.info("mounted %s over %s", opts.mountpoint, opts.backing)
        self.notify("ready")
        self.systemd.ready(f"serving {opts.mountpoint}; {self.summary()}")

        async def main() -> None:
            self._loop = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                async def on_signals() -> None:
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                        async for sig in sigs:
                            log.warning("got %s: unmounting %s, then persisting what is left",
                                        signal.Signals(sig).name, opts.mountpoint)
                            pyfuse3.terminate()
                            return
                nursery.start_soon(on_signals)
                self.core.start(nursery)

                async def read_ahead() -> None:
                    await trio.sleep(1.0)   # after the kernel's INIT, which sets its own value
                    set_read_ahead(opts.mountpoint)
                nursery.start_soon(read_ahead)
                nursery.start_soon(watch_detached, opts.mountpoint)
                nursery.start_soon(collector.run)
                if self.systemd.on:
                    nursery.start_soon(self._tell_systemd)
                await pyfuse3.main(min_tasks=4, max_tasks=64)
                nursery.cancel_scope.cancel()

        try:
            collector.start()
            trio.run(main)
        except BaseException:
            log.exception("the FUSE loop failed; persisting what is cached before exiting")
        finally:
            collector.stop()   # the drain's full collections are the interpreter's again
            fastwrite.stop_idle_poll()   # no request comes any more
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", opts.mountpoint)

    async def _tell_systemd(self) -> None:
        import trio
        while True:
            await trio.sleep(STATUS_EVERY)
            self.systemd.status(f"serving {self.opts.mountpoint}; {self.summary()}")

    def _metrics_text(self) -> str:
        """The metrics of this mount (``--metrics``; called by the endpoint's threads)."""
        from . import metrics
        return metrics.render([self._document()])

    def _document(self) -> dict:
        """The status document for a scrape: taken on the FUSE loop's thread while it runs,
        as ``user.acpfs.status`` is; once the loop has ended (the drain), here, where no
        request changes the files any more but the drain's own snapshot (``_quiet``)."""
        import trio

        from ..core import control
        if self._loop is None:
            raise Unavailable("acpfs is starting (allocating the cache, or recovering a dead "
                              "daemon's journal); see the log")
        take = lambda: control.status(self.flusher, self.info, self.core.wt)   # noqa: E731
        try:
            return trio.from_thread.run_sync(take, trio_token=self._loop)
        except trio.RunFinishedError:
            with self._quiet:
                return take()

    def summary(self) -> str:
        """One line of what is unsaved, for systemd's STATUS (and ``systemctl status``)."""
        fl, files = self.flusher, self.cache.files
        with fl.lock:
            ops, queued = len(fl.oplog.queue), fl.oplog.queued_bytes
        dirty = list(files.dirty_nodes)
        failing = fl.failing_op()
        return (f"{len(dirty)} files ({format_size(sum(n.size for n in dirty))}) unsaved, "
                f"{ops} operations ({format_size(queued)}) to persist, "
                f"{format_size(int(fl.rate()))}/s" +
                (f"; failing: {failing.path}: {failing.error}" if failing else ""))

    def drain(self) -> bool:
        """Queue what is still unsaved and wait until the flusher has persisted it all."""
        self.systemd.stopping(f"persisting before exit; {self.summary()}")
        with self._quiet:
            n = self.cache.files.snapshot_open_files()
        if n:
            log.warning("%d files were still open for writing at unmount; persisting what was "
                        "written to them", n)
        return drain(self.flusher,
                     lambda: self.systemd.extend(f"persisting before exit; {self.summary()}"))

    def close(self, drained: bool) -> int:
        """Release everything; the cache directory goes only when everything is persisted."""
        opts = self.opts
        if self.endpoint is not None:
            self.endpoint.close()
        if self.plane is not None:
            self.plane.close()
        if self.replication is not None:   # before the store: it holds references to it
            self.replication.close()
        self.journal.close()
        self.store.close()
        if self.peers is not None:
            self.peers.leave(drained)
        if drained:
            self.backing.remove_staging_dir()
        self.backing.close()
        if drained:
            shutil.rmtree(opts.cache_dir, ignore_errors=True)
            hugecache.release(opts.cache_dir)
            log.info("all changes persisted to %s; exiting", opts.backing)
        else:
            log.error("exiting with changes NOT persisted; the cache is kept in %s", opts.cache_dir)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        os.close(self.cache_lock_fd)
        self.systemd.close()
        return 0 if drained else 1


def run(opts: Options, notify: Callable[[str], None]) -> int:
    """Mount and serve until unmounted; ``notify`` gets progress lines, then 'ready'; so
    does systemd, where it asked (``NOTIFY_SOCKET``, sdnotify.py)."""
    systemd = Notifier.from_environment()

    def progress(msg: str) -> None:
        notify(msg)
        if msg.startswith("progress "):
            systemd.status(msg[len("progress "):])
    daemon = Daemon(opts, progress, systemd)
    daemon.build()
    daemon.recover()
    try:
        daemon.serve()
    finally:
        drained = daemon.drain()
    return daemon.close(drained)



