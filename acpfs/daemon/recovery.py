"""Recovery: a new daemon finishes what a dead one left in the cache directory.

``Daemon.recover`` (daemon.py) calls ``recover`` before it mounts, when the cache directory
holds a journal (``journal.read_leftover``). The journal's pending records are replayed, in
order, through the same methods a FUSE request would call, on the cache's owners themselves
(``cache.names``, ``cache.files``; ``Cache`` only builds them), onto a cache loaded from the
backing (``cache.coherence``): the backing already shows the history up to ``applied``, so
replaying the rest rebuilds the dead daemon's view, and queues every pending change again
(new seqs, same order) for the new flusher. File contents are not copied: replayed files
take over what the records name in the content store (pool blocks or memory files, reused
as they are: ``Store.claim_refs``).

Which records are replayed:
- operations with seq > applied (the one right after ``applied`` may already be in the
  backing: the dead flusher can have applied it without recording so; replaying it finds
  its source gone or its target present and is skipped, which is also what it would do);
- a "flushed" record that is the last word on its file: its close() was acknowledged but
  the dead daemon never queued it; it is published like a snapshot;
- never dropped: content (a publish or "flushed" record) whose directory is gone from the
  backing, or whose name a directory holds now, is kept aside in
  ``.acpfs-recovered/<time>-<instance>/`` (``Replayer.keep_aside``), logged at ERROR and
  listed in the status document;
- never over a newer file: a path that ``acpfs.torch`` saved straight to the backing while
  the daemon was dead (listed in the cache directory's ``direct-writes``) is newer than
  anything the journal holds for it; records that would replace, rename over or delete it
  are skipped, and logged. (Files changed in the backing by other means while no daemon
  runs may be overwritten by the replay: docs/faults.md.)
- a "dirty" record that is the last word on its file: the file was open for writing at the
  crash. Its unsaved content is never published over the backing version. If it was being
  written through (a staging file in the backing), that file is kept aside in
  ``.acpfs-recovered/<time>-<instance>/``; otherwise its cached changes are dropped. Both
  are logged at ERROR with the file's path, and listed in the status document.

Setting aside makes nothing in the backing during the recovery: the file is made in the
mount, under ``.acpfs-recovered/<time>-<instance>/``, through the same cache methods
(mkdir, create, snapshot), so it is one more pending change, journaled in the new journal
and published by the flusher like any other. Invariant: a backing that refuses changes
(read-only, immutable, out of quota) never stops the mount, as it never stops a running
daemon: the set-aside is retried in the background, shown in ``status.errors`` and the
log, and its content stays in the cache (or its staged file) and in the journal until it
lands. Staged files are opened read-only where the backing refuses to open them for
writing (``Staged.read_only``); the flusher opens them again before it publishes them.

A crash during recovery is recovered from the same journal again: the dead daemon's journal
is kept aside (``journal.recovering``) until the replay is complete, and the new flusher
only starts after that, so the backing does not move while the replay runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from typing import Callable

from ..backing.backing import RECOVERED_DIR, flat_name, staged_ino
from ..cache.cache import Cache
from ..oplog.journal import CONTENT_KINDS, DIRTY, FLUSHED, Leftover, Record
from ..backing.retry import retry
from ..node import Node, OpKind, Staged, node_path

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Recovered:
    """What a recovery did; shown in the status document under "recovery"."""
    started: float
    replayed_ops: int = 0
    files: int = 0
    skipped: int = 0
    lost_open_files: list[str] = dataclasses.field(default_factory=list)
    kept_aside: list[str] = dataclasses.field(default_factory=list)
    # each kept-aside path -> the seq of its publish: in the backing once the flusher's
    # applied seq reaches it (status: ``aside_pending``); not part of the document
    aside_seqs: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "aside_seqs"}


def plan(left: Leftover) -> tuple[list[Record], list[Record]]:
    """(records to replay in order, "dirty" records of files open at the crash).

    A "flushed" or "dirty" record names the file's path when it was written; renames of the
    file or of a directory above it that are already in the backing (seq <= applied) are
    not replayed, so the path is carried through them here (on copies: ``left`` is kept).
    """
    last: dict[int, int] = {}   # ino -> index of its last state or publish record
    for i, r in enumerate(left.records):
        if r.seq == 0 or r.kind == OpKind.PUBLISH:
            last[r.ino] = i
    replay: list[Record] = []
    open_at_crash: list[Record] = []
    moved: list[Record] = []    # copies whose path follows applied renames
    for i, r in enumerate(left.records):
        if r.seq > left.applied:
            replay.append(r)
        elif r.kind == OpKind.RENAME:
            src, dst = r.src_path, r.path
            if src is None or dst is None:
                continue
            def carried(p: bytes | None) -> bytes | None:
                if p is not None and (p == src or p.startswith(src + b"/")):
                    return dst + p[len(src):]
                return p
            for rec in moved:
                rec.path = carried(rec.path)
                rec.links = [c for c in map(carried, rec.links) if c is not None]
        elif r.kind in (FLUSHED, DIRTY) and last[r.ino] == i:
            rec = dataclasses.replace(r)
            moved.append(rec)
            (replay if r.kind == FLUSHED else open_at_crash).append(rec)
    return replay, open_at_crash


def claimed_content(records: list[Record]) -> list[list[int]]:
    """What each content record to be replayed names in the content store (one reference
    per record: ``Store.claim_refs``)."""
    return [r.blocks for r in records if r.kind in CONTENT_KINDS]


class Replayer:
    def __init__(self, cache: Cache, report: Recovered, direct: set[bytes]) -> None:
        self.cache = cache
        self.report = report
        self.direct = direct              # paths saved straight to the backing meanwhile
        self.taken_over: set[bytes] = set()   # staged files taken over by replayed files
        # .acpfs-recovered/<stamp>-<instance>/: that folder in the mount, once made
        self.stamp = time.strftime("%Y%m%dT%H%M%S").encode()
        self.aside_dir: Node | None = None

    def newer(self, *paths: bytes | None) -> bool:
        """Was one of ``paths`` saved straight to the backing after the daemon died?"""
        return any(p in self.direct for p in paths if p is not None)

    def _loaded(self, node: Node) -> Node:
        if node.children is None:
            listing = retry(lambda: self.cache.coherence.list_backing(node), f"listing {node_path(node)!r}")
            self.cache.coherence.attach_listing(node, listing)
        return node

    def resolve(self, path: bytes | None) -> tuple[Node | None, bytes, Node | None]:
        """(parent directory, name, node or None) for a mount path; parent None if unreachable."""
        if path is None:
            return None, b"", None
        if path == b"":
            return None, b"", self.cache.inodes.root
        *dirs, name = path.split(b"/")
        node = self.cache.inodes.root
        for d in dirs:
            node = self._loaded(node)
            child = node.entries().get(d)
            if child is None or not child.is_dir:
                return None, name, None
            node = child
        self._loaded(node)
        return node, name, node.entries().get(name)

    def skip(self, rec: Record, why: str, level: int = logging.INFO) -> None:
        self.report.skipped += 1
        path = rec.src_path if rec.kind == OpKind.RENAME else rec.path
        where = os.fsdecode(path) if path is not None else f"(inode {rec.ino})"
        log.log(level, "recovery: %s %s: skipped (%s)", rec.kind, where, why)

    def apply(self, rec: Record) -> None:
        """Replay one record through the cache, as the FUSE request it stands for would, or
        skip it (logged, counted in ``report.skipped``) where the backing shows it done or
        no longer possible."""
        if rec.kind in CONTENT_KINDS:
            self.content(rec)
            return
        self.report.replayed_ops += 1
        replay = self.BY_KIND.get(rec.kind)
        if replay is None:
            raise AssertionError(f"unknown journal record {rec.kind}")
        replay(self, rec)

    def _rename(self, rec: Record) -> None:
        p1, n1, node = self.resolve(rec.src_path)
        p2, n2, target = self.resolve(rec.path)
        if node is None or p1 is None or p2 is None:
            self.skip(rec, "source gone: applied before the crash, or never saved")
            return
        if self.newer(rec.src_path, rec.path):
            self.skip(rec, "saved straight to the backing after the daemon died", logging.WARNING)
            return
        if target is not None and target.is_dir:
            self._loaded(target)
        try:
            self.cache.names.rename(p1, n1, p2, n2)
        except OSError as e:
            self.skip(rec, e.strerror or str(e))

    def _link(self, rec: Record) -> None:
        _, _, node = self.resolve(rec.src_path)
        p2, n2, there = self.resolve(rec.path)
        if node is None or p2 is None or node.is_dir:
            self.skip(rec, "the file or the new name's directory is gone")
            return
        if there is not None:
            self.skip(rec, "already present" if there is node else "another file has the name")
            return
        self.cache.names.link(node, p2, n2)

    def _make(self, rec: Record) -> None:
        """mkdir, mknod, symlink."""
        parent, name, node = self.resolve(rec.path)
        if node is not None:
            self.skip(rec, "already present")
            return
        if parent is None:   # what was to go into it is kept aside (Replayer.keep_aside)
            self.skip(rec, "its parent is gone from the backing", logging.WARNING)
            return
        assert rec.uid is not None and rec.gid is not None
        if rec.kind == OpKind.MKDIR:
            assert rec.mode is not None
            self.cache.names.mkdir(parent, name, rec.mode, rec.uid, rec.gid)
        elif rec.kind == OpKind.MKNOD:
            assert rec.mode is not None
            self.cache.names.mknod(parent, name, rec.mode, rec.size, rec.uid, rec.gid)
        else:
            self.cache.names.symlink(parent, name, rec.target, rec.uid, rec.gid)

    def _remove(self, rec: Record) -> None:
        """unlink, rmdir."""
        parent, name, node = self.resolve(rec.path)
        rmdir = rec.kind == OpKind.RMDIR
        if node is None or parent is None or node.is_dir != rmdir:
            self.skip(rec, "already gone")
            return
        if node.is_dir:
            self._loaded(node)
        if self.newer(rec.path):
            self.skip(rec, "saved straight to the backing after the daemon died", logging.WARNING)
            return
        try:
            (self.cache.names.rmdir if rmdir else self.cache.names.unlink)(parent, name)
        except OSError as e:
            self.skip(rec, e.strerror or str(e))

    def _setattr(self, rec: Record) -> None:
        _, _, node = self.resolve(rec.path)
        if node is None or self.newer(rec.path):
            self.skip(rec, "gone, or saved straight to the backing after the daemon died")
            return
        times = rec.times
        self.cache.names.setattr(node, mode=rec.mode, uid=rec.uid, gid=rec.gid,
                           atime=times[0] if times else None, mtime=times[1] if times else None)

    def _set_xattr(self, rec: Record) -> None:
        _, _, node = self.resolve(rec.path)
        if node is None or node.is_link or self.newer(rec.path):
            self.skip(rec, "gone, or saved straight to the backing after the daemon died")
            return
        if node.xattrs is None:
            node.xattrs = retry(lambda: self._read_xattrs(node), f"reading xattrs of {rec.path!r}")
        try:
            self.cache.names.set_xattr(node, rec.key, rec.value)
        except OSError as e:
            self.skip(rec, e.strerror or str(e))

    # how ``apply`` replays each kind of record but content (publish, flushed)
    BY_KIND: dict[str, Callable[[Replayer, Record], None]] = {
        OpKind.RENAME: _rename, OpKind.LINK: _link,
        OpKind.MKDIR: _make, OpKind.MKNOD: _make, OpKind.SYMLINK: _make,
        OpKind.UNLINK: _remove, OpKind.RMDIR: _remove,
        OpKind.SETATTR: _setattr, OpKind.XATTR: _set_xattr,
    }

    def _read_xattrs(self, node: Node) -> dict[bytes, bytes]:
        cache = self.cache
        with cache.inodes.position_lock:
            if node is cache.inodes.root:
                return cache.backing.read_xattrs([], None)
            if node.backing_parent is None:
                return {}
            return cache.backing.read_xattrs(cache.inodes.backing_path(node.backing_parent), node.backing_name)

    def content(self, rec: Record) -> None:
        """A file's content at its last close: make it the file's content, queue it."""
        cache = self.cache
        staged = self._open_staged(rec.staged_name) if rec.staged_name else None
        if rec.staged_name and staged is None:
            self._release(rec)
            self.skip(rec, "its staged file is gone: published before the crash, or removed "
                      "from the backing by something else", logging.WARNING)
            return
        try:
            parent, name, node = self.resolve(rec.path)
        except OSError as e:
            self.keep_aside(rec, staged, f"its directory cannot be read ({e.strerror or e})")
            return
        if parent is None or (node is not None and not node.is_reg):
            self.keep_aside(rec, staged, "its directory is gone from the backing" if parent is None
                            else "a directory stands under its name in the backing now")
            return
        if self.newer(rec.path):
            self._release(rec)
            if staged is not None:
                staged.close(cache.backing.close_fd)
                self.taken_over.discard(rec.staged_name)
            self.skip(rec, "saved straight to the backing after the daemon died: that newer "
                      "version stays", logging.WARNING)
            return
        assert rec.mode is not None and rec.uid is not None and rec.gid is not None
        if node is None:
            node = cache.names.create(parent, name, rec.mode, rec.uid, rec.gid)
        self._relink(rec, node)
        self._publish(node, rec, staged)
        self.report.files += 1

    def _release(self, rec: Record) -> None:
        """The content ``rec`` names is not replayed: give back what recovery claimed for it."""
        with self.cache.oplog.lock:
            self.cache.store.drop(self.cache.store.adopt(rec.blocks))

    def _publish(self, node: Node, rec: Record, staged: Staged | None) -> None:
        """Give ``node`` the content ``rec`` describes (what it names in the store, claimed for
        it at build, or ``staged``) and queue its publish."""
        cache = self.cache
        assert rec.mode is not None and rec.uid is not None and rec.gid is not None
        assert rec.times is not None
        with cache.oplog.lock:
            if node.content is not None:
                cache.store.drop(node.content)
            cache.files.lru.pop(node.ino, None)
            content = cache.store.adopt(rec.blocks)
            if staged is not None:
                cache.store.drop(content)   # the staged file holds the content
            node.content = None if staged is not None else content
        node.staged = staged
        node.size = rec.size
        node.mode, node.uid, node.gid = rec.mode, rec.uid, rec.gid
        node.atime, node.mtime = rec.times
        node.xattrs = dict(rec.xattrs)
        node.dirty = True
        cache.files.snapshot(node)

    def _relink(self, rec: Record, node: Node) -> None:
        """The file's other names when its content was acknowledged (hard links): each one
        names it again, so that its publish lands the content under all of them. A name the
        backing shows as another file (a new version that reached only some names before
        the crash) is that file's no more."""
        for path in rec.links:
            parent, name, there = self.resolve(path)
            if there is node:
                continue
            if parent is None or (there is not None and not there.is_reg) or self.newer(path):
                self.skip(rec, f"its name {os.fsdecode(path)!r} cannot be given back "
                          "(its directory is gone, another kind of entry or a newer file is "
                          "there)", logging.WARNING)
                continue
            if there is not None:
                self.cache.names.unlink(parent, name)
            self.cache.names.link(node, parent, name)

    def keep_aside(self, rec: Record, staged: Staged | None, why: str) -> None:
        """Content whose close() was acknowledged cannot go where the mount had it: keep it
        in ``.acpfs-recovered/<time>-<instance>/`` instead, never drop it: content an
        application was told is saved is never lost to a recovery."""
        shown = os.fsdecode(rec.path) if rec.path is not None else f"(inode {rec.ino})"
        aside = self._set_aside(rec, staged, shown)
        log.error("recovery: %s: %s; the content its close() acknowledged is kept aside as %s "
                  "(served by the mount now; in the backing once it lands there, as any "
                  "change does)", shown, why, aside)

    def _set_aside(self, rec: Record, staged: Staged | None, shown: str) -> str:
        """Make ``.acpfs-recovered/<time>-<instance>/<shown, flat>`` in the mount with
        ``rec``'s content and queue its publish; returns its path. Nothing is written to the
        backing here (module docstring): the flusher lands it, retrying while the backing
        refuses."""
        cache = self.cache
        where = self._aside_folder()
        name = flat = flat_name(shown)
        n = 0
        while name in where.entries():
            n += 1                     # content kept aside never replaces other content
            name = flat + b"~%d" % n
        node = cache.names.create(where, name, rec.mode or 0o600, rec.uid or 0, rec.gid or 0)
        self._publish(node, rec, staged)
        aside = node_path(node)
        self.report.kept_aside.append(aside)
        self.report.aside_seqs[aside] = node.publish_ops[-1].seq
        return aside

    def _aside_folder(self) -> Node:
        """This recovery's folder in the mount, ``.acpfs-recovered/<time>-<instance>/``, made
        through the cache (queued mkdirs) where missing. ``.acpfs-recovered`` is shared by
        every node and user (mode 1777, as /tmp); each daemon keeps aside in a 0700 folder
        named after itself, so that daemons of several nodes recovering in the same second
        (a whole job restarted) never publish over each other's content; if something else
        stands under the name ``.acpfs-recovered``, ``.acpfs-recovered-<instance>`` is used."""
        if self.aside_dir is not None and self.aside_dir.parent is not None:
            return self.aside_dir
        cache = self.cache
        uid, gid = os.geteuid(), os.getegid()
        mine = b"-" + cache.backing.instance.encode()
        root = self._loaded(cache.inodes.root)
        top = None
        for name in (RECOVERED_DIR, RECOVERED_DIR + mine):
            there = root.entries().get(name)
            if there is None:
                top = cache.names.mkdir(root, name, 0o1777, uid, gid)
                break
            if there.is_dir:
                top = self._loaded(there)
                break
            log.warning("%r in the backing is not a directory: keeping aside in %r instead",
                        os.fsdecode(name), os.fsdecode(RECOVERED_DIR + mine))
        folder = self.stamp + mine
        there = top.entries().get(folder) if top is not None else None
        if top is None or (there is not None and not there.is_dir):
            taken = [RECOVERED_DIR] if top is None else [top.name, folder]
            raise OSError(errno.EEXIST, "no folder to keep content aside in: "
                          f"{os.fsdecode(b'/'.join(taken))!r} is not a directory in the backing")
        self.aside_dir = cache.names.mkdir(top, folder, 0o700, uid, gid) if there is None \
            else self._loaded(there)
        return self.aside_dir

    def _open_staged(self, tmpname: bytes) -> Staged | None:
        """A staged file the dead daemon left, None if gone. A backing that refuses to open
        it for writing (read-only) does not stop the recovery: it is opened for reading,
        and the flusher opens it again for writing before it publishes it."""
        backing = self.cache.backing
        read_only = False
        try:
            fds = backing.open_staged(tmpname)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            log.warning("recovery: the staged file %s cannot be opened for writing (%s): "
                        "read from it for now; it is published once the backing takes changes",
                        os.fsdecode(tmpname), e.strerror or e)
            fds = backing.open_staged(tmpname, write=False)
            read_only = True
        if fds is None:
            return None
        self.taken_over.add(tmpname)
        sp = Staged(fds[0], fds[1], tmpname)
        sp.read_only = read_only
        return sp

    def open_files(self, dirty: list[Record]) -> None:
        """Files open for writing at the crash: keep staged content aside, log the rest."""
        backing = self.cache.backing
        staged = {staged_ino(raw): raw for raw in backing.list_leftover_staged()
                  if raw not in self.taken_over and staged_ino(raw) is not None}
        for rec in dirty:
            path = rec.path
            shown = os.fsdecode(path) if path is not None else f"(inode {rec.ino}, deleted)"
            tmp = staged.pop(rec.ino, None)
            sp = self._open_staged(tmp) if tmp is not None and path is not None else None
            if sp is not None:
                st = backing.stat_fd(sp.fd)
                what = Record(0, FLUSHED, rec.ino, path, size=st.st_size, mode=st.st_mode,
                              uid=st.st_uid, gid=st.st_gid, times=(st.st_atime_ns, st.st_mtime_ns))
                aside = self._set_aside(what, sp, shown)
                log.error("recovery: %s was open for writing when the daemon died; its content "
                          "written so far is kept aside as %s (served by the mount now; in the "
                          "backing once it lands there, as any change does); the file itself "
                          "keeps its previous version", shown, aside)
            else:
                self.report.lost_open_files.append(shown)
                log.error("recovery: %s was open for writing when the daemon died; its changes "
                          "since it was opened are lost; the backing keeps its previous version",
                          shown)
        for tmp in staged.values():   # staged files of files deleted before the crash
            with contextlib.suppress(OSError):
                backing.remove_staged(tmp)
        backing.remove_leftover_staging_dir()


def recover(cache: Cache, left: Leftover, replay: list[Record], dirty: list[Record],
            progress: Callable[[int, int], None] | None = None) -> Recovered:
    """Replay ``replay`` (from ``plan``) into ``cache``; the flusher must not run yet."""
    report = Recovered(started=time.time())
    r = Replayer(cache, report, left.direct)
    t = time.monotonic()
    for i, rec in enumerate(replay):
        try:
            r.apply(rec)
        except OSError as e:
            if e.errno == errno.ENOSPC or rec.kind in CONTENT_KINDS:
                # acknowledged content is never dropped: the mount fails, the journal stays.
                # Only the backing's answers to reads get here (listings, opening a staged
                # file): setting content aside makes nothing in the backing (module docstring)
                raise
            r.skip(rec, str(e), logging.ERROR)
        except Exception as e:   # a bug: one record must not stop the rest from being recovered
            log.exception("recovery: cannot replay %s %s (seq %d)", rec.kind, rec.path, rec.seq)
            r.skip(rec, f"internal error: {e!r}", logging.ERROR)
        if progress and time.monotonic() - t > 0.5:
            t = time.monotonic()
            progress(i + 1, len(replay))
    r.open_files(dirty)
    return report
