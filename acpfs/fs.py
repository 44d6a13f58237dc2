"""The FUSE adapter: pyfuse3 requests in, ``Cache`` calls out.

Kept thin on purpose: it converts inode numbers and file handles to ``Node``s, runs the few
operations that must touch the backing (loading a directory, copying a file in, reading an
uncached file, statfs) in worker threads so that a slow or hung backing never stalls the
FUSE loop, waits (without blocking the loop) when the cache is full, and serves the
control attributes of ``control``. All semantics live in ``cache`` and ``flusher``.

Per-request cost matters (about 30 us of Python per request): ``write`` and ``read`` do no
logging, no allocation beyond what pyfuse3 hands over, and no backing I/O for cached files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import stat as statmod
import time
from typing import Any, AsyncIterator, Callable, TypeVar

from . import fastwrite  # before pyfuse3: it interposes fuse_session_new and _mount

import pyfuse3  # noqa: E402
import trio  # noqa: E402

from . import control  # noqa: E402
from .backing import TEMP_PREFIX, iter_extents
from .cache import Cache, Node, Spill
from .pool import PoolFull

log = logging.getLogger(__name__)
T = TypeVar("T")

ATTR_TIMEOUT = 5.0
STATFS_WAIT = 2.0  # seconds statfs waits for the backing before answering from memory
BLKSIZE = 1 << 20  # what stat reports: programs size their buffers by it


def fuse_errors(fn: Callable) -> Callable:
    """Turn OSError into FUSEError; anything else is a bug, logged with its traceback."""
    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Slot:
    """A node's staging slot, taken by ``Operations._hold``: what holds it, since when."""
    __slots__ = ("done", "why", "since")

    def __init__(self, why: str) -> None:
        self.done = trio.Event()
        self.why = why
        self.since = time.monotonic()


class SpillClosed(Exception):
    """The spill was published or discarded (closed) before it could be used."""


class Handle:
    __slots__ = ("node", "writable", "append", "bfd", "bgen")

    def __init__(self, node: Node, writable: bool, append: bool = False) -> None:
        self.node = node
        self.writable = writable
        self.append = append   # opened with O_APPEND
        self.bfd = -1    # backing copy, for files not in the cache
        self.bgen = 0    # Node.bgen when bfd was opened


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, cache: Cache, info: control.MountInfo) -> None:
        super().__init__()
        self.cache = cache
        self.info = info
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, list[tuple[bytes, Node]]] = {}
        self._next_fh = 1
        self._locks: dict[int, trio.Lock] = {}
        # Nodes whose staging file is being built or changed (``_hold``): every request that
        # changes such a node, and the last writer's release, waits (``settle``).
        self._spilling: dict[int, Slot] = {}
        self._spill_failed: dict[int, float] = {}
        self._full_since = 0.0
        self._statfs: os.statvfs_result | None = cache.backing.statvfs()   # the backing answers at mount
        self._statfs_call: trio.Event | None = None
        self.nursery: trio.Nursery | None = None   # for background work; set by the daemon

    # -- helpers -------------------------------------------------------------------------
    def attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink if not node.is_dir else 2
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_size = node.size
        a.st_blksize = BLKSIZE
        a.st_blocks = (node.size + 511) // 512
        a.st_atime_ns = node.atime
        a.st_mtime_ns = node.mtime
        a.st_ctime_ns = node.ctime
        return a

    def node(self, ino: int) -> Node:
        return self.cache.nodes[ino]

    def _lock(self, node: Node) -> trio.Lock:
        lk = self._locks.get(node.ino)
        if lk is None:
            lk = self._locks[node.ino] = trio.Lock()
        return lk

    async def loaded(self, node: Node) -> Node:
        """Make sure a directory's entries are known (read from the backing once)."""
        if node.children is None:
            if not node.is_dir:
                raise OSError(errno.ENOTDIR, "not a directory")
            async with self._lock(node):
                if node.children is None:
                    listing = await trio.to_thread.run_sync(self.cache.list_backing, node)
                    self.cache.attach_listing(node, listing)
            self._locks.pop(node.ino, None)
        return node

    async def xattrs_loaded(self, node: Node) -> dict[bytes, bytes]:
        if node.xattrs is None:
            cache = self.cache

            def read() -> dict[bytes, bytes]:
                with cache.bpos_lock:
                    if node is cache.root:
                        return cache.backing.read_xattrs([], None)
                    if node.bparent is None or node.is_link:
                        return {}
                    return cache.backing.read_xattrs(cache.bpath(node.bparent), node.bname)
            values = await trio.to_thread.run_sync(read)
            if node.xattrs is None:
                node.xattrs = values
        return node.xattrs

    async def cached(self, node: Node) -> None:
        """Bring the content of a file into the cache (before it is modified).

        A file whose last version is a spill still being published is waited for; a file
        larger than half the cache is copied into a spill file in the backing instead.
        """
        while True:
            await self.settle(node)
            if node.blocks is not None:
                return
            sp = node.spill
            if sp is None:
                break
            if not sp.handed:
                return
            await self.wait_seq(node.last_seq)   # then look again: others ran meanwhile
        # Nothing is staging the node, and no await since settle: spill_copy_up may stage it.
        if node.size > self.cache.pool.size // 2:
            await self.spill_copy_up(node)
            return
        async with self._lock(node):
            if node.blocks is None and node.spill is None:
                blocks = await self.with_space(lambda: self.cache.copy_up_blocks(node))
                try:
                    await trio.to_thread.run_sync(self.cache.read_backing_into, node, blocks)
                except BaseException:
                    self.cache.release_blocks(blocks)
                    raise
                if node.blocks is None and node.spill is None:
                    self.cache.attach_blocks(node, blocks)
                else:   # staged meanwhile (its size changed): that copy wins
                    self.cache.release_blocks(blocks)
        self._locks.pop(node.ino, None)

    async def preload(self, node: Node) -> bytes:
        """``user.acpfs.preload``: read a file's backing copy into the cache, for a fast resume.

        Never waits for the flusher: when the cache cannot hold the file even after evicting
        persisted files, the answer is ENOSPC at once. A preloaded file is clean and
        evictable like any persisted file.
        """
        if not node.is_reg:
            raise OSError(errno.EINVAL, "only regular files can be preloaded")
        await self.settle(node)
        if node.blocks is None and node.spill is None:
            if node.size > self.cache.pool.size:
                raise OSError(errno.EFBIG, "file larger than the cache")
            async with self._lock(node):
                if node.blocks is None:
                    try:
                        blocks = self.cache.copy_up_blocks(node)
                    except PoolFull:
                        raise OSError(errno.ENOSPC, "cache full") from None
                    try:
                        await trio.to_thread.run_sync(self.cache.read_backing_into, node, blocks)
                    except BaseException:
                        self.cache.release_blocks(blocks)
                        raise
                    self.cache.attach_blocks(node, blocks)
                    self.cache.maybe_evictable(node)
            self._locks.pop(node.ino, None)
        self.cache.touch(node)
        return json.dumps({"size": node.size, "cached": node.blocks is not None}).encode()

    async def with_space(self, fn: Callable[[], Any], node: Node | None = None) -> Any:
        """Call ``fn``; while the cache is full, wait for the flusher to free space.

        Writers are throttled to the backing store's speed this way. After
        ``cache_full_timeout`` seconds without progress they get ENOSPC.
        """
        try:
            return fn()
        except PoolFull:
            pass
        start = time.monotonic()
        if not self._full_since:
            self._full_since = start
            log.info("cache full (%d MiB): writers wait for the flusher to persist and free blocks",
                     self.cache.pool.size >> 20)
        delay = 0.001
        while True:
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)
            if time.monotonic() - start > 0.2:
                now = time.monotonic()
                for ino, when in list(self._spill_failed.items()):
                    if now - when > 10:   # let a failed write-through be tried again later
                        del self._spill_failed[ino]
                victim = self.cache.spill_candidate(exclude=self._spill_failed)
                if victim is None and node is not None and self._may_spill(node):
                    victim = node   # e.g. one write larger than the free cache
                if victim is not None and victim.ino not in self._spilling:
                    # in the background: on a hung backing this writer still gets its ENOSPC
                    self.nursery.start_soon(self._spill_bg, victim)
                    await trio.sleep(0)   # let it register in _spilling
            try:
                result = fn()
                self._full_since = 0.0
                return result
            except PoolFull:
                if time.monotonic() - start > self.info.cache_full_timeout:
                    log.error("cache full for %.0fs and nothing can be freed: returning ENOSPC "
                              "(is the backing store failing? see 'acpfs status')",
                              time.monotonic() - start)
                    raise OSError(errno.ENOSPC, "cache full") from None

    async def _stage(self, node: Node, fill: Callable[[int], None], why: str) -> Spill | None:
        """Create a spill file for ``node`` in the backing's staging directory.

        ``fill(fd)`` runs in a worker thread and writes the file's current content. While it
        runs, ``_spilling`` holds an event that every request changing the node waits for
        (``settle``); the node only gets its spill once the file is complete, and only if
        nothing replaced its content meanwhile. Returns None if staging failed.
        """
        cache = self.cache
        tmp = TEMP_PREFIX + f"{node.ino}-w{time.monotonic_ns()}".encode()
        blocks_before = node.blocks

        def run() -> tuple[int, int]:
            dfd, fd = cache.backing.create_staged(tmp)
            try:
                fill(fd)
            except BaseException:
                os.close(fd)
                cache.backing.remove_temp(dfd, tmp)
                os.close(dfd)
                cache.backing.remove_spill_dir()
                raise
            return dfd, fd

        async with self._hold(node, why):
            try:
                dfd, fd = await trio.to_thread.run_sync(run)
            except OSError as e:
                log.warning("cannot %s %s (%s); it stays in the cache", why, cache.path(node), e)
                return None
            sp = Spill()
            sp.dfd, sp.fd, sp.tmpname = dfd, fd, tmp
            if node.spill is not None or node.blocks is not blocks_before:
                self.cache.flusher.discard_spill(sp)  # type: ignore[union-attr]
                return None
            node.spill = sp
            return sp

    @contextlib.asynccontextmanager
    async def _hold(self, node: Node, why: str) -> AsyncIterator[None]:
        """Hold the node's slot in ``_spilling`` while its staging file is built or changed.

        Every request that changes the node, and its last writer's release (which hands the
        staging file to the flusher), waits in ``settle`` until the slot is given back.
        Invariant: one holder at a time. A caller takes the slot with no await since it
        last found the slot free (``settle``, or a check of ``_spilling``).
        """
        if node.ino in self._spilling:   # a bug: the request fails with EIO, logged
            raise RuntimeError(f"staging slot of {self.cache.path(node)!r} taken twice")
        slot = self._spilling[node.ino] = Slot(why)
        try:
            yield
        finally:
            del self._spilling[node.ino]
            slot.done.set()

    @staticmethod
    def _spill_gone(node: Node, sp: Spill) -> None:
        """After SpillClosed: a closed spill must have left its node, else going around
        again would never end."""
        if node.spill is sp:
            raise OSError(errno.EIO, "staging file closed while still in use")

    async def _on_spill(self, sp: Spill, fn: Callable[..., T], *args: Any) -> T:
        """``fn(sp.fd, *args)`` in a worker thread, with the spill pinned (``readers``) so that
        a publish or discard meanwhile closes its descriptor only afterwards. Raises
        SpillClosed if it is closed already."""
        lock = self.cache.lock
        with lock:
            if sp.closing or sp.fd < 0:
                raise SpillClosed()
            sp.readers += 1
        try:
            return await trio.to_thread.run_sync(fn, sp.fd, *args)
        finally:
            with lock:
                sp.readers -= 1
                if sp.closing and not sp.readers:
                    sp.close()

    def _may_spill(self, node: Node) -> bool:
        return (node.writers > 0 and node.spill is None and node.blocks is not None
                and node.ino not in self._spill_failed
                and node.ino not in self._spilling)

    async def settle(self, node: Node, deadline: float = math.inf) -> None:
        """Wait until nobody holds the node's staging slot (``_hold``); ENOSPC at
        ``deadline`` (trio clock) when the backing does not finish in time."""
        slot = self._spilling.get(node.ino)
        while slot is not None:
            with trio.move_on_at(deadline):
                await slot.done.wait()
            if not slot.done.is_set():
                log.error("%s: %s has taken %.0fs so far (is the backing hanging? see 'acpfs "
                          "status'): a write waiting for it gets ENOSPC", self.cache.path(node),
                          slot.why, time.monotonic() - slot.since)
                raise OSError(errno.ENOSPC, "cache full and the backing is not answering")
            slot = self._spilling.get(node.ino)

    async def spill(self, node: Node) -> bool:
        """Write a large open file through to the backing, freeing its cached blocks.

        Its blocks are copied to a staging file in the backing; from then on its writes and
        reads go to that file (at the backing's speed) and its last close hands the file to
        the flusher, which fsyncs it and renames it over the final name, in order.
        """
        cache = self.cache
        if not self._may_spill(node):   # its last writer may have closed it since it was picked
            return False
        with cache.lock:
            blocks = list(node.blocks or ())
            cache.pool.incref(blocks)
        size = node.size

        def fill(fd: int) -> None:
            cache.backing.copy_extents(fd, iter_extents(blocks, size, cache.bs), cache.pool.fd)
            os.ftruncate(fd, size)

        try:
            sp = await self._stage(node, fill, "write through")
        finally:
            cache.release_blocks(blocks)
        if sp is None:
            self._spill_failed[node.ino] = time.monotonic()
            return False
        with cache.lock:
            cache.pool.decref(node.blocks or [])
            node.blocks = None
        log.info("cache full: writing %s through to the backing from now on (%d MiB were cached)",
                 cache.path(node), size >> 20)
        return True

    async def persist_open_files(self) -> None:
        """Files open for writing for a long time (logs, event files) do not stay in RAM only.

        After ``persist_open_after`` seconds of unsaved changes, a file that is only appended
        to (every writer opened it with O_APPEND, and it was not truncated since its last
        version) is published as it is: the backing's version is always a prefix of the
        file. Any other file, and any file already written through, is written through to a staging file in the backing (fsynced
        again every period), which is published only at its last close: a partial file
        never replaces a complete one. A daemon crash keeps that staged content aside
        (recovery.py).
        """
        age = self.info.persist_open_after
        if age <= 0:
            return
        synced: dict[int, float] = {}
        while True:
            await trio.sleep(min(5.0, max(0.2, age / 4)))
            now = time.time()
            for node in list(self.cache.dirty_nodes):
                if not (node.writers and node.nlink and node.is_reg) or now - node.dirty_since < age:
                    continue
                sp = node.spill
                if sp is not None:
                    # Written through (also an appended-only file, when the cache was full):
                    # it stays staged until its last close. Publishing it now would hand the
                    # staging file to the flusher while the writer still writes into it.
                    if not sp.handed and now - synced.get(node.ino, 0.0) >= age:
                        synced[node.ino] = now
                        self.nursery.start_soon(self._sync_spill, sp)
                elif self._appended_only(node) and node.ino not in self._spilling:
                    await self.settle(node)
                    if node.dirty and node.writers and node.spill is None:
                        log.info("%s has been open with unsaved appends for %.0fs: persisting "
                                 "what it holds so far", self.cache.path(node), now - node.dirty_since)
                        self.cache.snapshot(node)
                elif self._may_spill(node):
                    log.info("%s has been open with unsaved changes for %.0fs: staging its "
                             "content in the backing (published at its last close)",
                             self.cache.path(node), now - node.dirty_since)
                    self.nursery.start_soon(self._spill_bg, node)

    def _appended_only(self, node: Node) -> bool:
        if node.truncated:
            return False
        writers = [h for h in self.handles.values() if h.node is node and h.writable]
        return bool(writers) and all(h.append for h in writers)

    async def _sync_spill(self, sp: Spill) -> None:
        try:
            await self._on_spill(sp, os.fsync)
        except SpillClosed:
            pass
        except OSError as e:
            log.warning("fsync of a staged file failed: %s", e)

    async def _spill_bg(self, node: Node) -> None:
        try:
            await self.spill(node)
        except Exception:
            log.exception("internal error writing %s through to the backing", self.cache.path(node))

    async def spill_copy_up(self, node: Node) -> None:
        """Open a file larger than half the cache for writing: copy it into a spill file."""
        cache = self.cache
        size = node.size

        def fill(fd: int) -> None:
            with cache.bpos_lock:
                if node.bparent is None:
                    raise OSError(errno.EIO, "file lost its backing copy")
                src = cache.backing.open_file(cache.bpath(node.bparent), node.bname)
            try:
                cache.backing.copy_file(src, fd, size)
            finally:
                os.close(src)

        if await self._stage(node, fill, "copy for writing") is None and node.spill is None \
                and node.blocks is None:
            raise OSError(errno.EIO, "cannot stage a copy of this file for writing")

    async def _spill_read(self, sp: Spill, off: int, size: int) -> bytes | None:
        """Read from a spill file; None if it was closed (published) meanwhile."""
        try:
            return await self._on_spill(sp, os.pread, size, off)
        except SpillClosed:
            return None

    async def wait_seq(self, seq: int) -> None:
        fl = self.cache.flusher
        assert fl is not None
        delay = 0.001
        while fl.applied_seq < seq:
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    # -- namespace -----------------------------------------------------------------------
    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        parent = await self.loaded(self.node(parent_inode))
        node = self.cache.lookup(parent, name)
        node.lookups += 1
        return self.attrs(node)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            node = self.cache.nodes.get(ino)
            if node is not None and node is not self.cache.root:
                self.cache.forget(node, n)

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        return self.attrs(self.node(inode))

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self.node(inode)
        cache = self.cache
        if fields.update_size:
            if not node.is_reg:
                raise OSError(errno.EINVAL, "not a regular file")
            size = attr.st_size
            await self.xattrs_loaded(node)
            # Each pass looks at the node afresh: other requests, the flusher and eviction
            # run at every await.
            while True:
                await self.settle(node)
                sp = node.spill
                if sp is not None and sp.handed:
                    await self.wait_seq(node.last_seq)   # its last version is being published
                    continue
                if sp is None and node.blocks is None and size:
                    if not node.nlink and not node.opens:
                        node.size = size   # deleted and dropped meanwhile: nothing to keep
                        break
                    await self.cached(node)   # (again, if it was evicted while we waited)
                    continue
                if sp is not None:
                    # The slot keeps the last writer's release (which would hand the staging
                    # file to the flusher) and every write waiting until the file is cut.
                    async with self._hold(node, "truncate of its staged copy"):
                        cache.note_change(node)
                        try:
                            await self._on_spill(sp, os.ftruncate, size)
                        except SpillClosed:
                            self._spill_gone(node, sp)
                            continue   # discarded (the file was deleted): look again
                        node.size = size
                        cache.mark_written(node, size)
                        if node.writers == 0 and node.nlink:
                            cache.snapshot(node)
                    break
                # False: the node was staged or evicted while we waited for space; go around
                if await self.with_space(
                        lambda: False if node.spill is not None or node.ino in self._spilling
                        or (size and node.blocks is None) else cache.truncate(node, size) or True,
                        node):
                    break
        if fields.update_mode or fields.update_uid or fields.update_gid or fields.update_atime \
                or fields.update_mtime:
            cache.setattr(node,
                          mode=attr.st_mode if fields.update_mode else None,
                          uid=attr.st_uid if fields.update_uid else None,
                          gid=attr.st_gid if fields.update_gid else None,
                          atime=attr.st_atime_ns if fields.update_atime else None,
                          mtime=attr.st_mtime_ns if fields.update_mtime else None)
        return self.attrs(node)

    @fuse_errors
    async def readlink(self, inode, ctx):
        node = self.node(inode)
        if not node.is_link:
            raise OSError(errno.EINVAL, "not a symlink")
        return node.target

    @fuse_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        parent = await self.loaded(self.node(parent_inode))
        node = self.cache.mkdir(parent, name, mode & ~ctx.umask, ctx.uid, self._gid(parent, ctx))
        if parent.mode & statmod.S_ISGID:
            node.mode |= statmod.S_ISGID
        node.lookups += 1
        return self.attrs(node)

    def _gid(self, parent: Node, ctx) -> int:
        return parent.gid if parent.mode & statmod.S_ISGID else ctx.gid

    @fuse_errors
    async def unlink(self, parent_inode, name, ctx):
        parent = await self.loaded(self.node(parent_inode))
        self.cache.unlink(parent, name)

    @fuse_errors
    async def rmdir(self, parent_inode, name, ctx):
        parent = await self.loaded(self.node(parent_inode))
        await self.loaded(self.cache.lookup(parent, name))
        self.cache.rmdir(parent, name)

    @fuse_errors
    async def symlink(self, parent_inode, name, target, ctx):
        parent = await self.loaded(self.node(parent_inode))
        node = self.cache.symlink(parent, name, target, ctx.uid, self._gid(parent, ctx))
        node.lookups += 1
        return self.attrs(node)

    @fuse_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        p1 = await self.loaded(self.node(parent_inode_old))
        p2 = await self.loaded(self.node(parent_inode_new))
        target = p2.children.get(name_new)  # type: ignore[union-attr]
        if target is not None and target.is_dir:
            await self.loaded(target)
        self.cache.rename(p1, name_old, p2, name_new, noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    @fuse_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise OSError(errno.EPERM, "hard links are not supported")

    @fuse_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise OSError(errno.EPERM, "only regular files, directories and symlinks are supported")

    # -- directories ---------------------------------------------------------------------
    @fuse_errors
    async def opendir(self, inode, ctx):
        node = await self.loaded(self.node(inode))
        fh = self._new_fh()
        self.dirs[fh] = list(node.children.items())  # type: ignore[union-attr]
        return fh

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        entries = self.dirs[fh]
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            if not pyfuse3.readdir_reply(token, name, self.attrs(node), i + 1):
                break
            node.lookups += 1

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    async def fsyncdir(self, fh, datasync):
        if self.info.fsync_backing:
            await self.wait_seq(self.cache.seq)

    # -- files ---------------------------------------------------------------------------
    @fuse_errors
    async def open(self, inode, flags, ctx):
        node = self.node(inode)
        if node.is_dir:
            raise OSError(errno.EISDIR, "is a directory")
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC) and writable
        await self.settle(node)
        if writable:
            await self.xattrs_loaded(node)
            if not trunc:
                await self.cached(node)
            else:
                await self.settle(node)
                sp = node.spill
                if sp is not None and not sp.handed:
                    # held: the last other writer's release must not hand the file over
                    # half cut (see setattr)
                    async with self._hold(node, "truncate of its staged copy"):
                        self.cache.note_change(node)
                        try:
                            await self._on_spill(sp, os.ftruncate, 0)
                        except SpillClosed:
                            self._spill_gone(node, sp)   # discarded: Cache.open truncates the rest
                        else:
                            node.size = 0
                            self.cache.mark_written(node, 0)
        h = Handle(node, writable, bool(flags & os.O_APPEND))
        # Readers of a cached file skip the page cache where shared mmap survives it: each
        # READ is then one copy from the pool into the reader's buffer (the page cache path
        # copies twice and allocates a page per 4 KiB). Files read from the backing keep
        # the page cache and its read-ahead.
        direct = writable or (node.blocks is not None and fastwrite.readers_direct_io())
        if not writable and node.blocks is None and node.spill is None and node.is_reg:
            # Open the backing copy now, so that the reader keeps the version it opened
            # even if the file is renamed over, deleted or republished meanwhile.
            await self._open_backing(h)
        self.cache.open(node, writable, trunc)
        fh = self._new_fh()
        self.handles[fh] = h
        # direct_io for writers: 1 MiB requests straight into the pool, no page cache cap.
        # Other readers keep the page cache (mmap works), dropped on each open.
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=False)

    @fuse_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        parent = await self.loaded(self.node(parent_inode))
        node = self.cache.create(parent, name, mode & ~ctx.umask, ctx.uid, self._gid(parent, ctx))
        # The creating handle always counts as a writer, so that the new file is
        # published at its last close even when it was opened read-only.
        self.cache.open(node, True, False)
        node.lookups += 1
        fh = self._new_fh()
        self.handles[fh] = Handle(node, True, bool(flags & os.O_APPEND))
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False), self.attrs(node)

    async def read(self, fh, off, size):
        try:
            h = self.handles[fh]
            node = h.node
            sp = node.spill
            if sp is not None:
                data = await self._spill_read(sp, off, size)
                if data is not None:
                    return data
            data = self.cache.read(node, off, size)
            if data is not None:
                self.cache.touch(node)
                return data
            if h.bfd < 0 or (h.bgen != node.bgen and node.nlink):
                await self._open_backing(h)
            return await trio.to_thread.run_sync(os.pread, h.bfd, size, off)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in read")
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def _open_backing(self, h: Handle) -> None:
        """(Re)open the backing copy of the handle's file for reading."""
        cache = self.cache
        node = h.node

        def open_backing() -> tuple[int, int]:
            with cache.bpos_lock:
                if node.bparent is None or node.bstale:
                    raise OSError(errno.EIO, "file has no backing copy")
                return cache.backing.open_file(cache.bpath(node.bparent), node.bname), node.bgen
        fd, gen = await trio.to_thread.run_sync(open_backing)
        if h.bfd >= 0:
            os.close(h.bfd)
        h.bfd, h.bgen = fd, gen

    def write_now(self, fh: int, off: int, data: memoryview) -> int | None:
        """WRITE straight from libfuse's buffer (acpfs/_fastwrite.c): bytes written, -errno,
        or None to take the async path (``write``), which waits for space or a spill.
        ``data`` is valid only during this call; ``Cache.write`` copies it into the pool."""
        try:
            node = self.handles[fh].node
            if node.spill is not None or node.ino in self._spilling:
                return None
            return self.cache.write(node, off, data)
        except PoolFull:
            return None
        except OSError as e:
            return -(e.errno or errno.EIO)
        except Exception:
            log.exception("internal error in write")
            return -errno.EIO

    async def write(self, fh, off, buf):
        try:
            node = self.handles[fh].node
            if node.spill is None and node.ino not in self._spilling:
                try:
                    return self.cache.write(node, off, buf)
                except PoolFull:
                    pass
            deadline = trio.current_time() + self.info.cache_full_timeout
            while True:
                await self.settle(node, deadline)
                sp = node.spill
                if sp is not None:
                    # held: a truncate of the staging file and this write never overlap (the
                    # size kept would not match the file's)
                    async with self._hold(node, "write to its staged copy"):
                        self.cache.note_change(node)
                        try:
                            n = await self._on_spill(sp, os.pwrite, buf, off)
                        except SpillClosed:
                            self._spill_gone(node, sp)
                            continue
                        self.cache.mark_written(node, off + n)
                    return n
                # None: the node started being written through while we waited; go around
                if len(buf) > self.cache.pool.size // 2 and self._may_spill(node):
                    self.nursery.start_soon(self._spill_bg, node)   # this write alone nearly fills the cache
                    await trio.sleep(0)
                    continue
                n = await self.with_space(
                    lambda: None if node.spill is not None or node.ino in self._spilling
                    else self.cache.write(node, off, buf), node)
                if n is not None:
                    return n
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in write")
            raise pyfuse3.FUSEError(errno.EIO) from None

    @fuse_errors
    async def flush(self, fh):
        # close() returns when FLUSH is answered; RELEASE follows without being waited for.
        # So the content that close() acknowledges is journaled here (Cache.record_close).
        # No waiting for a spill being built: the blocks stay valid until it is complete,
        # and the record holds them.
        h = self.handles.get(fh)
        if h is not None and h.writable and h.node.writers == 1:
            self.cache.record_close(h.node)

    @fuse_errors
    async def release(self, fh):
        h = self.handles.pop(fh)
        if h.writable:
            await self.settle(h.node)
        try:
            self.cache.release(h.node, h.writable)
        finally:
            if h.bfd >= 0:
                os.close(h.bfd)

    @fuse_errors
    async def fsync(self, fh, datasync):
        if self.info.fsync_backing:
            node = self.handles[fh].node
            await self.settle(node)
            sp = node.spill
            if sp is not None and not sp.handed:
                # written through: the bytes so far become durable in the staging file;
                # the file is renamed into place at its last close
                try:
                    await self._on_spill(sp, os.fsync)
                    return
                except SpillClosed:
                    pass    # published meanwhile (this handle is read-only): wait for that
            await self.wait_seq(self.cache.fsync_snapshot(node))

    @fuse_errors
    async def statfs(self, ctx):
        # The backing's numbers, asked at most once at a time and waited for at most
        # STATFS_WAIT seconds: on a hung backing the last answer is given (statvfs is how
        # 'acpfs status' tells a live mount from a stale one, so it must not hang).
        if self._statfs_call is None:
            self._statfs_call = trio.Event()
            self.nursery.start_soon(self._refresh_statfs, self._statfs_call)
        with trio.move_on_after(STATFS_WAIT):
            await self._statfs_call.wait()
        st = self._statfs
        if st is None:
            raise OSError(errno.EIO, "the backing directory is not answering")
        out = pyfuse3.StatvfsData()
        for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                    "f_favail", "f_namemax"):
            setattr(out, key, getattr(st, key))
        return out

    async def _refresh_statfs(self, done: trio.Event) -> None:
        try:
            self._statfs = await trio.to_thread.run_sync(self.cache.backing.statvfs,
                                                         abandon_on_cancel=True)
        except OSError as e:
            log.warning("statvfs of the backing failed: %s", e)
        finally:
            self._statfs_call = None
            done.set()

    # -- extended attributes -------------------------------------------------------------
    @fuse_errors
    async def getxattr(self, inode, name, ctx):
        node = self.node(inode)
        if name == control.PRELOAD:
            return await self.preload(node)
        if name.startswith(control.PREFIX):
            return control.get(self.cache, self.info, node, name)
        if not name.startswith(b"user."):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        value = (await self.xattrs_loaded(node)).get(name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @fuse_errors
    async def setxattr(self, inode, name, value, ctx):
        node = self.node(inode)
        if name.startswith(control.PREFIX):
            raise OSError(errno.EPERM, "acpfs control attributes are read-only")
        if not name.startswith(b"user.") or node.is_link:
            raise OSError(errno.ENOTSUP, "only user extended attributes are supported")
        await self.xattrs_loaded(node)
        self.cache.set_xattr(node, name, value)

    @fuse_errors
    async def listxattr(self, inode, ctx):
        node = self.node(inode)
        return list(await self.xattrs_loaded(node))

    @fuse_errors
    async def removexattr(self, inode, name, ctx):
        node = self.node(inode)
        if name.startswith(control.PREFIX):
            raise OSError(errno.EPERM, "acpfs control attributes are read-only")
        await self.xattrs_loaded(node)
        try:
            self.cache.set_xattr(node, name, None)
        except OSError:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
