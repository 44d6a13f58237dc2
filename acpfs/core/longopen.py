"""Files open for writing for a long time (logs, event files, a writer the kernel passes
through): their unsaved changes do not stay in RAM only.

Owns the period's bookkeeping: when each staged file was last fsynced, the copies of
memory files of writers passed through being made (``_copying``) and the staged copies
made (``Node.open_copy``, which only this module sets and clears). ``run`` looks every
period at the files dirty for longer than ``persist_open_after`` seconds:

- a file only appended to is published as it is (its backing version is a prefix of it);
- a file written through is fsynced again (published at its last close);
- a file the kernel writes itself gets a whole copy staged (``_copy_open``), again while
  it changes, removed at its last writer's close (``closed``);
- any other file is written through (``WriteThrough.start_write_through``).

Runs on the trio thread, as a task of the daemon's nursery (``Core.start``); it takes no
staging slot itself, and leaves a file whose slot is held alone. Backing I/O runs in worker
threads.
"""

from __future__ import annotations

import logging
import time

import trio

from ..cache.files import Files
from ..node import Node, Staged, node_path
from .writethrough import Background, StagedClosed, WriteThrough

log = logging.getLogger(__name__)


class LongOpen:
    def __init__(self, files: Files, wt: WriteThrough, background: Background,
                 persist_open_after: float) -> None:
        self.files = files
        self.wt = wt
        self.background = background
        self.backing = files.backing
        self.persist_open_after = persist_open_after
        self._copying: set[int] = set()       # ino: a staged copy of it is being made (_copy_open)

    async def run(self) -> None:
        """Files open for writing for a long time (logs, event files) do not stay in RAM only.

        After ``persist_open_after`` seconds of unsaved changes, a file that is only appended
        to (``Node.appended_only``) is published as it is: the backing's version is always a
        prefix of the file. Any other file is written through to a staged file (fsynced
        again every period), which is published only at its last close: a partial file never
        replaces a complete one. A daemon crash keeps that staged content aside (recovery.py).
        """
        age = self.persist_open_after
        if age <= 0:
            return
        synced: dict[int, float] = {}
        while True:
            await trio.sleep(min(5.0, max(0.2, age / 4)))
            now = time.time()
            for node in list(self.files.dirty_nodes):
                if not (node.writers and node.nlink and node.is_reg) or now - node.dirty_since < age:
                    continue
                sp = node.staged
                if sp is not None:
                    # Written through (also an appended-only file, when the cache was full):
                    # it stays staged until its last close. Publishing it now would hand the
                    # staged file to the flusher while the writer still writes into it.
                    if not sp.queued and now - synced.get(node.ino, 0.0) >= age:
                        synced[node.ino] = now
                        self.background.start_soon(self._sync_staged, sp)
                elif node.appended_only and node.ino not in self.wt.slots:
                    await self.wt.settle(node)
                    if node.dirty and node.writers and node.staged is None \
                            and not self.files.unchanged_since_snapshot(node):
                        log.info("%s has been open with unsaved appends for %.0fs: persisting "
                                 "what it holds so far", node_path(node), now - node.dirty_since)
                        self.files.snapshot(node)
                elif node in self.files.passthrough_writers:
                    # the kernel writes its memory file: a copy of it is staged (the crash
                    # insurance that writing through gives elsewhere), again every period
                    if node.ino not in self._copying and now - synced.get(node.ino, 0.0) >= age:
                        synced[node.ino] = now
                        self._copying.add(node.ino)
                        self.background.start_soon(self._copy_open, node)
                elif self.wt.may_write_through(node):
                    log.info("%s has been open with unsaved changes for %.0fs: staging its "
                             "content in the backing (published at its last close)",
                             node_path(node), now - node.dirty_since)
                    self.wt.start_write_through(node)

    async def _copy_open(self, node: Node) -> None:
        """Stage a copy of the memory file of a writer passed through (``Node.open_copy``):
        complete and fsynced under a fresh name, then renamed over the last copy
        (``Backing.restage``), so a crash finds one whole copy, which recovery keeps aside
        like a staged file. The kernel may write meanwhile: the copy is of the moment it was
        read, as any reader's. Removed at the last writer's close (``closed``)."""
        files, backing = self.files, self.backing
        try:
            files.sync_content(node)
            if node.content is None or node not in files.passthrough_writers:
                return
            seen = node.content.seen
            name = node.open_copy[0] if node.open_copy is not None else backing.staged_name(node.ino)
            if node.open_copy is not None and node.open_copy[1] == seen:
                return   # unchanged since the last copy
            if node.open_copy is None:
                log.info("%s has been open with unsaved changes for %.0fs: staging a copy of "
                         "its content in the backing (again while it changes; the file is "
                         "published at its last close)", node_path(node), time.time() - node.dirty_since)
            with files.oplog.lock:
                content = files.store.share(node.content)
            size = node.size

            def run() -> None:
                with files.store.source(content, size) as (src_fd, _):
                    dfd, fd = backing.restage(src_fd, name, size)
                backing.close_fd(fd)
                backing.close_fd(dfd)

            try:
                await trio.to_thread.run_sync(run)
            except OSError as e:
                log.warning("cannot stage a copy of %s, open for writing (%s): a crash now "
                            "would lose its changes since it was opened", node_path(node), e)
                return
            finally:
                files.release_content(content)
            node.open_copy = (name, seen)
        finally:
            self._copying.discard(node.ino)
        if not node.writers:   # closed while the copy was made
            await self.closed(node)

    async def closed(self, node: Node) -> None:
        """The last writer of ``node`` closed it: its staged copy (``_copy_open``) goes (a
        copy being made goes when it is done)."""
        if node.open_copy is None or node.ino in self._copying or node.writers:
            return
        name, node.open_copy = node.open_copy[0], None
        try:
            await trio.to_thread.run_sync(self._remove_copy, name)
        except OSError as e:
            log.warning("cannot remove the staged copy %r of %s: %s", name, node_path(node), e)

    def _remove_copy(self, name: bytes) -> None:
        self.backing.remove_staged(name)
        self.backing.remove_staging_dir(name)

    async def _sync_staged(self, sp: Staged) -> None:
        try:
            await self.wt.on_staged(sp, self.backing.fsync)
        except StagedClosed:
            pass
        except OSError as e:
            log.warning("fsync of a staged file failed: %s", e)
