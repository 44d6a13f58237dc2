"""Recovery: a new daemon finishes what a dead one left in the cache directory.

``daemon.run`` calls ``recover`` before it mounts, when the cache directory holds a journal
(``journal.read_leftover``). The journal's pending records are replayed, in order, through
the same ``Cache`` methods a FUSE request would call, onto a cache loaded from the backing:
the backing already shows the history up to ``applied``, so replaying the rest rebuilds the
dead daemon's view, and queues every pending change again (new seqs, same order) for the
new flusher. File contents are not copied: replayed files take over the pool blocks the
records name (the pool file is reused as it is).

Which records are replayed:
- operations with seq > applied (the one right after ``applied`` may already be in the
  backing: the dead flusher can have applied it without recording so; replaying it finds
  its source gone or its target present and is skipped, which is also what it would do);
- a "flushed" record that is the last word on its file: its close() was acknowledged but
  the dead daemon never queued it; it is published like a snapshot;
- never over a newer file: a path that ``acpfs.torch`` saved straight to the backing while
  the daemon was dead (listed in the cache directory's ``direct-writes``) is newer than
  anything the journal holds for it; records that would replace, rename over or delete it
  are skipped, and logged. (Files changed in the backing by other means while no daemon
  runs may be overwritten by the replay: docs/faults.md.)
- a "dirty" record that is the last word on its file: the file was open for writing at the
  crash. Its unsaved content is never published over the backing version. If it was being
  written through (a staging file in the backing), that file is kept aside in
  ``.acpfs-recovered/<time>/``; otherwise its cached changes are dropped. Both are logged
  at ERROR with the file's path, and listed in the status document.

A crash during recovery is recovered from the same journal again: the dead daemon's journal
is kept aside (``journal.recovering``) until the replay is complete, and the new flusher
only starts after that, so the backing does not move while the replay runs.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
import urllib.parse
from typing import TYPE_CHECKING

from .backing import SPILL_DIR, TEMP_PREFIX
from .cache import Node, Spill
from .journal import Leftover, unpack_blocks
from .retry import retry

if TYPE_CHECKING:
    from .cache import Cache

log = logging.getLogger(__name__)

RECOVERED_DIR = b".acpfs-recovered"
CONTENT_KINDS = ("publish", "flushed")


@dataclasses.dataclass
class Recovered:
    """What a recovery did; shown in the status document under "recovery"."""
    started: float
    replayed_ops: int = 0
    files: int = 0
    skipped: int = 0
    lost_open_files: list[str] = dataclasses.field(default_factory=list)
    kept_aside: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan(left: Leftover) -> tuple[list[tuple], list[tuple]]:
    """(records to replay in order, "dirty" records of files open at the crash).

    A "flushed" or "dirty" record names the file's path when it was written; renames of the
    file or of a directory above it that are already in the backing (seq <= applied) are
    not replayed, so the path is carried through them here.
    """
    last: dict[int, int] = {}
    for i, r in enumerate(left.records):
        if r[0] == 0 or r[1] == "publish":
            last[r[2]] = i
    replay: list[tuple] = []
    open_at_crash: list[tuple] = []
    moved: list[list] = []    # records (as lists) whose path follows applied renames
    for i, r in enumerate(left.records):
        seq, kind = r[0], r[1]
        if seq > left.applied:
            replay.append(r)
        elif kind == "rename":
            src, dst = r[3], r[4]
            for rec in moved:
                p = rec[3]
                if p is None or src is None or dst is None:
                    continue
                if p == src:
                    rec[3] = dst
                elif p.startswith(src + b"/"):
                    rec[3] = dst + p[len(src):]
        elif kind in ("flushed", "dirty") and last[r[2]] == i:
            rec = list(r)
            moved.append(rec)
            (replay if kind == "flushed" else open_at_crash).append(rec)  # type: ignore[arg-type]
    return [tuple(r) for r in replay], [tuple(r) for r in open_at_crash]


def claimed_blocks(records: list[tuple]) -> list[int]:
    """Every pool block named by a content record to be replayed (with repeats: one
    reference per record)."""
    out: list[int] = []
    for r in records:
        if r[1] in CONTENT_KINDS:
            out.extend(b for b in unpack_blocks(r[10]) if b >= 0)
    return out


class Replayer:
    def __init__(self, cache: Cache, report: Recovered, direct: set[bytes]) -> None:
        self.cache = cache
        self.report = report
        self.direct = direct              # paths saved straight to the backing meanwhile
        self.spills: set[bytes] = set()   # staging files taken over by replayed files

    def newer(self, *paths: bytes | None) -> bool:
        """Was one of ``paths`` saved straight to the backing after the daemon died?"""
        return any(p in self.direct for p in paths if p is not None)

    def _loaded(self, node: Node) -> Node:
        if node.children is None:
            listing = retry(lambda: self.cache.list_backing(node), f"listing {self.cache.path(node)!r}")
            self.cache.attach_listing(node, listing)
        return node

    def resolve(self, path: bytes | None) -> tuple[Node | None, bytes, Node | None]:
        """(parent directory, name, node or None) for a mount path; parent None if unreachable."""
        if path is None:
            return None, b"", None
        if path == b"":
            return None, b"", self.cache.root
        *dirs, name = path.split(b"/")
        node = self.cache.root
        for d in dirs:
            node = self._loaded(node)
            child = node.children.get(d)  # type: ignore[union-attr]
            if child is None or not child.is_dir:
                return None, name, None
            node = child
        self._loaded(node)
        return node, name, node.children.get(name)  # type: ignore[union-attr]

    def skip(self, rec: tuple, why: str, level: int = logging.INFO) -> None:
        self.report.skipped += 1
        log.log(level, "recovery: %s %s: skipped (%s)", rec[1],
                os.fsdecode(rec[3]) if len(rec) > 3 and isinstance(rec[3], bytes) else rec[2], why)

    def apply(self, rec: tuple) -> None:
        kind = rec[1]
        cache = self.cache
        if kind in CONTENT_KINDS:
            self.content(rec)
            return
        self.report.replayed_ops += 1
        if kind == "rename":
            src_path, dst_path = rec[3], rec[4]
            p1, n1, node = self.resolve(src_path)
            p2, n2, target = self.resolve(dst_path)
            if node is None or p1 is None or p2 is None:
                self.skip(rec, "source gone: applied before the crash, or never saved")
                return
            if self.newer(src_path, dst_path):
                self.skip(rec, "saved straight to the backing after the daemon died", logging.WARNING)
                return
            if target is not None and target.is_dir:
                self._loaded(target)
            try:
                cache.rename(p1, n1, p2, n2)
            except OSError as e:
                self.skip(rec, e.strerror or str(e))
            return
        parent, name, node = self.resolve(rec[3])
        if kind in ("mkdir", "symlink"):
            if parent is None or node is not None:
                self.skip(rec, "already present" if node is not None else "parent gone")
                return
            if kind == "mkdir":
                cache.mkdir(parent, name, rec[4], rec[5], rec[6])
            else:
                cache.symlink(parent, name, rec[4], rec[5], rec[6])
        elif kind in ("unlink", "rmdir"):
            if node is None or parent is None or node.is_dir != (kind == "rmdir"):
                self.skip(rec, "already gone")
                return
            if node.is_dir:
                self._loaded(node)
            if self.newer(rec[3]):
                self.skip(rec, "saved straight to the backing after the daemon died", logging.WARNING)
                return
            try:
                (cache.rmdir if kind == "rmdir" else cache.unlink)(parent, name)
            except OSError as e:
                self.skip(rec, e.strerror or str(e))
        elif kind == "setattr":
            if node is None or self.newer(rec[3]):
                self.skip(rec, "gone, or saved straight to the backing after the daemon died")
                return
            mode, uid, gid, times = rec[4:8]
            cache.setattr(node, mode=mode, uid=uid, gid=gid,
                          atime=times[0] if times else None, mtime=times[1] if times else None)
        elif kind == "xattr":
            if node is None or node.is_link or self.newer(rec[3]):
                self.skip(rec, "gone, or saved straight to the backing after the daemon died")
                return
            if node.xattrs is None:
                node.xattrs = retry(lambda: self._read_xattrs(node), f"reading xattrs of {rec[3]!r}")
            try:
                cache.set_xattr(node, rec[4], rec[5])
            except OSError as e:
                self.skip(rec, e.strerror or str(e))
        else:
            raise AssertionError(f"unknown journal record {kind}")

    def _read_xattrs(self, node: Node) -> dict[bytes, bytes]:
        cache = self.cache
        with cache.bpos_lock:
            if node is cache.root:
                return cache.backing.read_xattrs([], None)
            if node.bparent is None:
                return {}
            return cache.backing.read_xattrs(cache.bpath(node.bparent), node.bname)

    def content(self, rec: tuple) -> None:
        """A file's content at its last close: make it the file's content, queue it."""
        cache = self.cache
        (_, kind, _, path, size, mode, uid, gid, times, xattrs, packed, spill_name) = rec
        blocks = unpack_blocks(packed)
        parent, name, node = self.resolve(path)
        spill = None
        if spill_name:
            spill = self._open_spill(spill_name)
        if parent is None or (node is not None and not node.is_reg) or (spill_name and spill is None):
            with cache.lock:
                cache.pool.decref(blocks)
            self.skip(rec, "its directory is gone" if parent is None else
                      "its staging file is gone: published before the crash" if node is None or node.is_reg
                      else "replaced by a directory")
            return
        if self.newer(path):
            with cache.lock:
                cache.pool.decref(blocks)
            if spill is not None:
                spill.close()
                self.spills.discard(spill_name)
            self.skip(rec, "saved straight to the backing after the daemon died: that newer "
                      "version stays", logging.WARNING)
            return
        if node is None:
            node = cache.create(parent, name, mode, uid, gid)
        with cache.lock:
            if node.blocks:
                cache.pool.decref(node.blocks)
            cache.lru.pop(node.ino, None)
            node.blocks = None if spill is not None else blocks
        node.spill = spill
        node.size = size
        node.mode, node.uid, node.gid = mode, uid, gid
        node.atime, node.mtime = times
        node.xattrs = dict(xattrs)
        node.dirty = True
        cache.snapshot(node)
        self.report.files += 1

    def _open_spill(self, tmpname: bytes) -> Spill | None:
        backing = self.cache.backing
        try:
            dfd = os.open(SPILL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=backing.root_fd)
        except FileNotFoundError:
            return None
        try:
            fd = os.open(tmpname, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            os.close(dfd)
            return None
        sp = Spill()
        sp.dfd, sp.fd, sp.tmpname = dfd, fd, tmpname
        self.spills.add(tmpname)
        return sp

    def open_files(self, dirty: list[tuple]) -> None:
        """Files open for writing at the crash: keep staged content aside, log the rest."""
        backing = self.cache.backing
        staged: dict[int, bytes] = {}
        try:
            dfd = os.open(SPILL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=backing.root_fd)
            try:
                names = os.listdir(dfd)
            finally:
                os.close(dfd)
            for name in names:
                raw = os.fsencode(name)
                if raw in self.spills or not raw.startswith(TEMP_PREFIX):
                    continue
                ino = raw[len(TEMP_PREFIX):].split(b"-", 1)[0]
                if ino.isdigit():
                    staged[int(ino)] = raw
        except FileNotFoundError:
            pass
        stamp = time.strftime("%Y%m%dT%H%M%S").encode()
        for rec in dirty:
            ino, path = rec[2], rec[3]
            shown = os.fsdecode(path) if path is not None else f"(inode {ino}, deleted)"
            tmp = staged.pop(ino, None)
            if tmp is not None and path is not None:
                aside = self._keep_aside(tmp, stamp, path)
                self.report.kept_aside.append(aside)
                log.error("recovery: %s was open for writing when the daemon died; its content "
                          "written so far is kept aside as %s in the backing; the file itself "
                          "keeps its previous version", shown, aside)
            else:
                self.report.lost_open_files.append(shown)
                log.error("recovery: %s was open for writing when the daemon died; its changes "
                          "since it was opened are lost; the backing keeps its previous version",
                          shown)
        for tmp in staged.values():   # staging files of files deleted before the crash
            try:
                os.unlink(SPILL_DIR + b"/" + tmp, dir_fd=backing.root_fd)
            except OSError:
                pass
        backing.remove_spill_dir()

    def _keep_aside(self, tmp: bytes, stamp: bytes, path: bytes) -> str:
        root = self.cache.backing.root_fd
        for d in (RECOVERED_DIR, RECOVERED_DIR + b"/" + stamp):
            try:
                os.mkdir(d, 0o700, dir_fd=root)
            except FileExistsError:
                pass
        flat = urllib.parse.quote(os.fsdecode(path), safe="").encode()
        dst = RECOVERED_DIR + b"/" + stamp + b"/" + flat
        os.rename(SPILL_DIR + b"/" + tmp, dst, src_dir_fd=root, dst_dir_fd=root)
        return os.fsdecode(dst)


def recover(cache: Cache, left: Leftover, replay: list[tuple], dirty: list[tuple],
            progress=None) -> Recovered:
    """Replay ``replay`` (from ``plan``) into ``cache``; the flusher must not run yet."""
    report = Recovered(started=time.time())
    r = Replayer(cache, report, left.direct)
    t = time.monotonic()
    for i, rec in enumerate(replay):
        try:
            r.apply(rec)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise
            r.skip(rec, str(e), logging.ERROR)
        except Exception as e:   # a bug: one record must not stop the rest from being recovered
            log.exception("recovery: cannot replay %s", rec[:4])
            r.skip(rec, f"internal error: {e!r}", logging.ERROR)
        if progress and time.monotonic() - t > 0.5:
            t = time.monotonic()
            progress(i + 1, len(replay))
    r.open_files(dirty)
    return report
