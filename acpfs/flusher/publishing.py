"""Landing a file's new version in the backing: the sequencer's part of a publish.

When the sequencer reaches a publish (``Publisher.apply``), it waits for the op's upload
(``Uploads``), renames the temporary file over the file's name (making way for what another
writer left there, ``Repairs.make_way``), then gives the new version each other name the
file has: those it had when queued (``publish_links``: a hard link renamed over the version
before, one name after the other) and those another node linked that this node does not
know (``unknown_names``). ``link`` also applies a link op. Everything here runs on the
sequencer thread, backing paths under ``Inodes.position_lock``.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import stat as statmod
import threading
import time
from typing import Callable

from .attempts import Attempts
from .groups import Group
from ..backing.backing import Backing, Comps, MissingDir
from ..cache.cache import Cache
from ..oplog.ops import Link, Publish
from .repairs import Repairs, kind_of, version_of
from ..backing.retry import describe
from ..node import Node, OpState
from .uploads import Uploads

log = logging.getLogger(__name__)
Version = tuple[int, int, int]


class Publisher:
    def __init__(self, cache: Cache, backing: Backing, lock: threading.Condition,
                 attempts: Attempts, repairs: Repairs, uploads: Uploads,
                 meanwhile: Callable[[], None], group: Group | None = None) -> None:
        self.cache = cache
        self.backing = backing
        self.lock = lock
        self.attempts = attempts
        self.repairs = repairs
        self.uploads = uploads
        self.meanwhile = meanwhile   # with lock held, while the sequencer waits for an upload
        self.group = group           # where a rename's directory fsync waits (groups.py)

    def apply(self, op: Publish) -> None:
        """Land ``op`` (its state DONE), or drop it if it went void (VOID)."""
        if not self._uploaded(op):
            self._drop(op)
            return
        staged = op.snap.staged is not None
        seen = op.node.backing_version   # the version before this one, at every name
        try:
            unknown = self._land(op)
        finally:
            if not staged and op.dir_fd >= 0:
                self.backing.close_fd(op.dir_fd)
        if staged:
            self.backing.remove_staging_dir(op.temp_name)
        if op.links:
            self.publish_links(op, seen)
        if unknown:
            self.publish_unknown_names(op, unknown, seen)
        op.state = OpState.DONE

    def _uploaded(self, op: Publish) -> bool:
        """Wait for the op's upload (starting it if the flusher has not); False if the op
        went void. Raises Aborted on an abort."""
        while True:
            with self.lock:
                if op.future is None and op.state == OpState.QUEUED:
                    self.uploads.start(op)
                fut = op.future
            if fut is None:
                break  # void before any upload started
            done, _ = cf.wait([fut], timeout=0.05)
            if done:
                break
            with self.lock:
                self.meanwhile()
        uploaded = fut.result() if fut is not None else False   # raises Aborted on abort
        with self.lock:
            void = op.state == OpState.VOID or not uploaded
            if not void:
                op.state = OpState.FINALIZING
        return not void

    def _drop(self, op: Publish) -> None:
        """A void op: its temporary file, if written, is removed."""
        if op.dir_fd >= 0:
            try:
                self.backing.remove_temp(op.dir_fd, op.temp_name)
            except OSError as e:   # our own leftover: 'acpfs temps' finds it
                log.warning("%r: cannot remove its temporary file %r (%s)", op.path,
                            os.fsdecode(op.temp_name), describe(e))
            if op.snap.staged is None:
                self.backing.close_fd(op.dir_fd)
            else:
                self.backing.remove_staging_dir(op.temp_name)
        op.state = OpState.VOID

    def _land(self, op: Publish) -> list[tuple[Comps, bytes]] | None:
        """Rename the temporary file over the file's first name; returns the names of it in
        the backing that this node does not know (``unknown_names``)."""
        cache = self.cache
        redo = False
        unknown: list[tuple[Comps, bytes]] | None = None   # its names this node does not know

        def run() -> None:
            nonlocal redo, unknown
            if redo:
                self.uploads.redo(op)
                redo = False
            with cache.inodes.position_lock:
                node = op.node
                comps = cache.inodes.backing_path(op.parent)
                mine = node.position_at(op.parent, op.name) is not None
                self.repairs.make_way(op, comps, op.name, node if mine else None)
                if mine and unknown is None:
                    # whatever this node counts: another node may have linked it since
                    unknown = self.unknown_names(op, comps)
                # the directory where the file is now, by path: the one the temporary file
                # was written in may have been moved away meanwhile
                dst = self.backing.open_dir(comps)
                try:
                    # the version as written, taken before the rename (which keeps it): read
                    # at the name after it, it may already be another node's, published
                    # right after ours, and this node would take that for its own
                    version = self.backing.version(op.dir_fd, op.temp_name)
                    # a staged file's temporary file is in another directory; a linked
                    # file's other names land right after, each fsynced at once
                    group = self.group if op.snap.staged is None and not op.links else None
                    if self.backing.publish(op.dir_fd, op.temp_name, dst, op.name,
                                            defer=group is not None):
                        group.keep(dst)   # fsynced with the rest of the group, its own now
                        dst = -1
                finally:
                    if dst >= 0:
                        self.backing.close_fd(dst)
                # its other names still hold the version before, until publish_links
                first = (op.parent, op.name)
                node.set_positions([first] + [p for p in node.positions()
                                              if p[0] is not first[0] or p[1] != first[1]])
                node.backing_version, node.checked_at = version, time.monotonic()
                node.generation += 1
                if op.links:   # names of it that listings meet later join it (Coherence._attach)
                    cache.inodes.linked[version[0]] = node

        def repair(exc: BaseException) -> None:
            nonlocal redo
            if isinstance(exc, MissingDir):
                self.repairs.restore_dirs(op.parent, exc)
            elif isinstance(exc, OSError) and not self.backing.temp_exists(op.dir_fd, op.temp_name):
                redo = True

        self.attempts.until_done(run, op, "publish of", repair)
        return unknown

    def unknown_names(self, op: Publish, comps: Comps) -> list[tuple[Comps, bytes]]:
        """Before a new version of a file with several names replaces the one at its first
        name (hold position_lock): the names of it in the backing that this node does not
        know (another node or program linked them in directories this node has not listed
        since), found by their inode in the backing tree. The new version lands under them
        too (``_publish_unknown_names``); a name that cannot be found (outside the backing)
        keeps the version before: the link is split there, a conflict, so that it shows."""
        node = op.node
        st = self.backing.stat_entry(comps, op.name)
        known = node.positions()
        if st is None or not statmod.S_ISREG(st.st_mode) or st.st_nlink <= len(known) \
                or version_of(st) != node.backing_version:
            return []
        mine = {(tuple(self.cache.inodes.backing_path(d)), name) for d, name in known}
        found = self.backing.find_names(st.st_ino, st.st_nlink - len(known), mine)
        if len(found) + len(known) < st.st_nlink:
            missing = st.st_nlink - len(known) - len(found)
            self.repairs.conflicts.note("split", op.path, f"publishes a new version of this file of "
                                f"{len(known) + len(found)} names found",
                                f"the file under {st.st_nlink} names (the others outside the "
                                f"backing directory)", f"the names it cannot reach ({missing}) "
                                "keep the version before: the link is split there")
        return found

    def publish_unknown_names(self, op: Publish, names: list[tuple[Comps, bytes]],
                               seen: Version | None) -> None:
        """The new version of a linked file, now under its first name, goes under each of its
        names that this node does not know (``unknown_names``), one after the other as in
        ``publish_links``; a name that no longer holds the version before (``seen``) was
        changed by another writer meanwhile and is left to it."""
        cache = self.cache
        todo = list(names)

        def run() -> None:
            with cache.inodes.position_lock:
                src = cache.inodes.backing_path(op.parent)
                while todo:
                    dcomps, name = todo[0]
                    st = self.backing.stat_entry(dcomps, name)
                    if st is not None and statmod.S_ISREG(st.st_mode) and version_of(st) == seen:
                        self.backing.link(src, op.name, dcomps, name)
                    todo.pop(0)

        self.attempts.until_done(run, op, "publish of", lambda exc: None)

    def publish_links(self, op: Publish, seen: Version | None) -> None:
        """A file with hard links: its new version, now under its first name, goes under each
        other name it had when queued, one name after the other, each in one step (a link
        renamed over the version before, ``seen``). Until the last one, the names still to
        come hold the version before: the one exception to "the backing is a state the
        mount had" (docs/semantics.md, hard links)."""
        cache = self.cache
        first = [(op.parent, op.name)]
        todo = list(op.links or ())

        def run() -> None:
            with cache.inodes.position_lock:
                while todo:
                    d, name = todo[0]
                    # the name keeps its position (the version before) until it is replaced
                    self.link(op, first, d, name, seen)
                    todo.pop(0)

        def repair(exc: BaseException) -> None:
            if todo:
                self.repairs.restore_dirs(todo[0][0], exc)
        self.attempts.until_done(run, op, "publish of", repair)

    def link(self, op: Publish | Link, sources: list[tuple[Node, bytes]], dst: Node, name: bytes,
              seen: Version | None = None) -> None:
        """Give ``op``'s node the name ``dst``/``name`` in the backing too (hold position_lock):
        a hard link to its copy at the first of ``sources`` still there, made under a
        temporary name and renamed into place, so that the name goes from what stood there
        straight to the file. ``seen``: the version this node left at the name itself. With
        no source left (none yet, or all removed by another writer) nothing is done: the
        node's next publish lands under every name it has then (``Publish.links``)."""
        node = op.node
        dcomps = self.cache.inodes.backing_path(dst)
        for pos in sources:
            src = self.cache.inodes.backing_path(pos[0])
            self.repairs.make_way(op, dcomps, name, None, seen)
            try:
                self.backing.link(src, pos[1], dcomps, name)
            except FileNotFoundError as e:
                if isinstance(e, MissingDir) and e.comps is not src:
                    raise       # the destination's directory: Repairs.restore_dirs makes it
                if self.backing.exists(src, pos[1]):
                    raise
                self.repairs.conflicts.note("gone", op.path, f"links this {kind_of(node)} from "
                                    f"{os.fsdecode(b'/'.join(src + [pos[1]]))!r}",
                                    "nothing at the source", "linked from another of its names, "
                                    "or landed by its next snapshot")
                node.move_position(pos, None)
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # the backing forbids the link: no retry can help, the queue must move on
                self.repairs.conflicts.note("refused", op.path, f"links this {kind_of(node)}",
                                    f"a backing that refuses it ({describe(e)})",
                                    "this name is kept in this mount only")
                return
            if node.position_at(dst, name) is None:
                node.set_positions(node.positions() + [(dst, name)])
            if node.is_reg and node.backing_version is not None:
                self.cache.inodes.linked[node.backing_version[0]] = node   # as in _land
            return
