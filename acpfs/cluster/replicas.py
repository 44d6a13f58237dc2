"""Replicas this node holds of other nodes' unsaved changes (``--replicas 1`` on theirs),
and the takeover of a dead node's (docs/design.md, "Replicas of unsaved changes").

A node with ``--replicas 1`` sends its journal, as it writes it, with the content each
record names, to one other node (replicate.py). That node keeps, per origin, a copy of
the origin's journal (``Held``): the records since the origin's journal was last cut back,
the origin's applied seq, and the content of the records not yet applied, one file each
under ``<cache dir>.replicas/<origin>/files/``. It is a cache directory in the making:
when the origin's record has expired (its lease ran out) and its plane does not answer,
this node writes the journal out and runs ``acpfs recover`` over it (``take_over``), which
replays it in the origin's order with global order kept, exactly as a restart of the
origin would, and removes it once all of it is in the backing.

Global order while a replica waits: this node counts the oldest change it holds for a
suspect origin (its record older than half its lease, or expired) in its own frontier
(``frontier``), so the other nodes go on waiting for those changes after the origin's
lease runs out, until the recovery's own record carries them (the origin's record then
says "left") or the recovery ends.

The stream (``ENTRY`` then the payload, then the content): ``RECORD`` (a journal record,
encoded; its content follows, or ``reuse`` names the entry whose content it shares),
``RESET`` (the origin's journal was cut back: everything before is dropped) and
``APPLIED`` (the origin's applied seq). Entries are numbered from 1 in the order sent; a
batch must start where this node stands (``next``) or with a RESET.

Owns ``Held`` per origin, the bytes held against ``--replica-budget``, and the takeovers;
``_lock`` guards all of it (the plane's threads, the peers' thread and status read it).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from typing import BinaryIO, Callable

from ..oplog.journal import APPLIED as APPLIED_FILE, FLUSHED, FRAME, HEADER, JOURNAL, MAGIC, Record
from .plane import parse_address
from .records import LEFT, RecordName

log = logging.getLogger(__name__)

ENTRY = struct.Struct("<BdIQQ")   # kind, stamp, payload bytes, content bytes, reuse (entry no.)
RECORD, RESET, APPLIED, APPLIED_RECORD = 1, 2, 3, 4   # the last: a record of an op applied
PAYLOAD_MAX = 16 << 20   # a record: paths, a symlink's target, extended attributes
PIECE = 1 << 20
MIN_POOL = 64 << 20


@dataclasses.dataclass
class Entry:
    record: Record
    stamp: float
    content: int = 0        # the file holding its content (0: none, or freed)
    size: int = 0


class Held:
    """What this node holds of one origin's journal."""

    def __init__(self, origin: str, top: str) -> None:
        self.origin = origin
        self.dir = os.path.join(top, origin)
        self.files = os.path.join(self.dir, "files")
        os.makedirs(self.files, mode=0o700, exist_ok=True)
        self.entries: list[Entry] = []
        self.by_no: dict[int, int] = {}     # entry number -> its content file (reuse)
        self.refs: dict[int, int] = {}      # content file -> entries naming it
        self.sizes: dict[int, int] = {}     # content file -> bytes
        self.applied = 0
        self.next = 1                        # the number of the next entry expected
        self.last_seen = time.time()
        self._id = 0
        self.io = threading.Lock()          # one batch of this origin at a time

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def pending(self) -> list[Entry]:
        """The entries a takeover would replay: ops past ``applied``, and each file's last
        state record if it is "flushed" (recovery.plan)."""
        last: dict[int, int] = {}
        for i, e in enumerate(self.entries):
            if e.record.seq == 0 or e.record.kind == "publish":
                last[e.record.ino] = i
        return [e for i, e in enumerate(self.entries)
                if e.record.seq > self.applied
                or (e.record.seq == 0 and e.record.kind == FLUSHED and last[e.record.ino] == i)]

    def frontier(self) -> float | None:
        stamps = [e.stamp for e in self.pending() if e.stamp]
        return min(stamps) if stamps else None

    def _unref(self, fid: int) -> None:
        self.refs[fid] -= 1
        if not self.refs[fid]:
            del self.refs[fid], self.sizes[fid]
            try:
                os.unlink(os.path.join(self.files, str(fid)))
            except FileNotFoundError:
                pass

    def reset(self) -> None:
        for e in self.entries:
            if e.content:
                self._unref(e.content)
        self.entries.clear()
        self.by_no.clear()

    def set_applied(self, seq: int) -> None:
        """Content of records applied is in the backing: freed (the records stay: a rename
        applied still carries the path of a file closed before it, recovery.plan)."""
        self.applied = max(self.applied, seq)
        for e in self.entries:
            if e.content and 0 < e.record.seq <= self.applied:
                self._unref(e.content)
                e.content = 0

    def new_file(self, n: int) -> int:
        """(the replicas' lock) A content file for ``n`` bytes, counted at once (``bytes``)
        so that the budget holds while it is written (outside the lock: ``fill``)."""
        self._id += 1
        self.sizes[self._id] = n
        self.refs[self._id] = 1
        return self._id

    def fill(self, fid: int, body: BinaryIO, n: int) -> None:
        """(one batch of this origin at a time; no lock) Content file ``fid`` from the stream."""
        with open(os.path.join(self.files, str(fid)), "wb") as f:
            left = n
            while left:
                piece = body.read(min(PIECE, left))
                if not piece:
                    raise EOFError("the stream ended inside a content")
                f.write(piece)
                left -= len(piece)

    def add(self, no: int, record: Record, stamp: float, fid: int, reuse: int) -> None:
        """(the replicas' lock) Entry ``no``: a record, with the content file ``fid`` (written,
        one reference taken) or that of entry ``reuse``."""
        if not fid and reuse:
            fid = self.by_no.get(reuse, 0)
            if fid not in self.refs:
                fid = 0
            elif fid:
                self.refs[fid] += 1
        if fid:
            self.by_no[no] = fid
        record.blocks = [fid] if fid else []
        if record.seq and record.seq <= self.applied and fid:   # applied meanwhile
            self._unref(fid)
            fid = 0
            record.blocks = []
        self.entries.append(Entry(record, stamp, fid, self.sizes.get(fid, 0)))

    def write_cache_dir(self) -> None:
        """The journal, as the origin's would read after its crash (journal.read_leftover)."""
        pool = max(2 * self.bytes, MIN_POOL)
        with open(os.path.join(self.dir, JOURNAL), "wb") as f:
            f.write(HEADER.pack(MAGIC, 0, pool, self.origin.encode()))
            for e in self.entries:
                payload = e.record.encode()
                f.write(FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
        with open(os.path.join(self.dir, APPLIED_FILE), "wb") as f:
            f.write(self.applied.to_bytes(8, "little"))


class Replicas:
    """The replicas held here (``receive``, from the plane) and the takeovers."""

    def __init__(self, top: str, budget: int, recover_args: list[str]) -> None:
        self.top = top
        self.budget = budget
        self.recover_args = recover_args   # acpfs recover's options but --cache-dir, --log-file
        self._lock = threading.Lock()
        self.held: dict[str, Held] = {}
        self.takeovers: dict[str, dict] = {}   # origin -> its takeover's state
        self.covered: set[str] = set()   # taken over, and the recovery's record carries them
        self.received_bytes = 0
        self.refused = 0
        self.failed: dict[str, str] = {}
        os.makedirs(top, mode=0o700, exist_ok=True)
        for name in os.listdir(top):   # replicas do not outlive this daemon, but a takeover
            path = os.path.join(top, name)   # it started (acpfs recover) may still run
            if not os.path.isdir(path) or locked(os.path.join(path, "lock")):
                continue
            if os.path.exists(os.path.join(path, JOURNAL)):   # a takeover that did not end
                log.error("replicas: %s holds the unsaved changes of a dead node that were not "
                          "all persisted; run acpfs recover --cache-dir %s with this backing",
                          path, path)
                continue
            shutil.rmtree(path, ignore_errors=True)

    def used(self) -> int:
        return sum(h.bytes for h in self.held.values())

    def receive(self, origin: str, first: int, body: BinaryIO, length: int) -> tuple[int, str]:
        """One batch from ``origin``: (the next entry this node expects, "" or why it stopped
        short: the budget, a gap). The stream is read without the lock (the peers' thread
        and the sequencer read ``frontier`` under the op log's lock); one batch per origin
        at a time (``Held.io``)."""
        with self._lock:
            if origin in self.takeovers:
                return 0, "this node took over that origin"
            h = self.held.get(origin)
            if h is None:
                h = self.held[origin] = Held(origin, self.top)
            h.last_seen = time.time()
        with h.io:
            got, no = 0, first
            while got < length:
                head = body.read(ENTRY.size)
                if len(head) < ENTRY.size:
                    raise EOFError("the stream ended inside an entry")
                kind, stamp, plen, clen, reuse = ENTRY.unpack(head)
                if kind not in (RECORD, RESET, APPLIED, APPLIED_RECORD) or plen > PAYLOAD_MAX \
                        or (clen and kind != RECORD):
                    raise ValueError(f"a malformed entry (kind {kind}, {plen} + {clen} bytes)")
                payload = body.read(plen)
                if len(payload) < plen:
                    raise EOFError("the stream ended inside an entry")
                record = Record.decode(payload) if kind in (RECORD, APPLIED_RECORD) else None
                got += ENTRY.size + plen + clen
                with self._lock:
                    if kind != RESET and no != h.next:
                        return h.next, f"entry {no} sent where {h.next} was expected"
                    if origin in self.takeovers:
                        return 0, "this node took over that origin"
                    fid = 0
                    if kind == RESET:
                        h.reset()
                    elif kind == APPLIED:
                        h.set_applied(int.from_bytes(payload, "little"))
                    elif clen:
                        room = self.budget - self.used()
                        if clen > room:
                            self.refused += 1
                            return h.next, (f"the replica budget is full ({clen} bytes of "
                                            f"content, {max(room, 0)} left)")
                        fid = h.new_file(clen)
                if fid:
                    try:
                        h.fill(fid, body, clen)
                    except BaseException:
                        with self._lock:
                            h._unref(fid)
                        raise
                with self._lock:
                    if record is not None:
                        h.add(no, record, stamp, fid, reuse)
                        self.received_bytes += clen
                        if kind == APPLIED_RECORD:   # applied before it was sent: in order,
                            h.set_applied(record.seq)   # so is everything before it
                    h.next = no + 1
                no += 1
            return h.next, ""

    def frontier(self, suspect: Callable[[str], bool]) -> float | None:
        """The oldest change held for an origin that ``suspect`` says may be dead, or that
        is being taken over (its recovery's record may not carry it yet)."""
        with self._lock:
            # a takeover that failed holds nobody any more (an ERROR and status say so)
            fronts = [h.frontier() for o, h in self.held.items() if o not in self.covered
                      and (self.takeovers[o]["state"] == "running" if o in self.takeovers
                           else suspect(o))]
        fronts = [f for f in fronts if f is not None]
        return min(fronts) if fronts else None

    def look(self, records: dict[str, RecordName], now: float, lease: float,
             done: Callable[[str], None]) -> None:
        """After a listing of the node records (the peers' thread): replicas of an origin
        that left (unmounted, or restarted: its successor replays its own journal) are
        dropped; an origin whose lease ran out and whose plane does not answer is taken
        over; one whose recovery's record took over its own (it says "left") no longer
        holds this node's frontier."""
        with self._lock:
            held = dict(self.held)
        for origin, h in held.items():
            r = records.get(origin)
            if origin in self.takeovers:
                if r is None or r.state == LEFT:
                    with self._lock:
                        self.covered.add(origin)
                continue
            if r is None:
                if time.time() - h.last_seen > 2 * lease:
                    self.drop(origin, "its record is gone")
            elif r.state == LEFT:
                self.drop(origin, "it left: unmounted, or restarted over its own journal")
            elif now - r.heartbeat > lease and not answers(r.address):
                self.take_over(origin, f"its record is {now - r.heartbeat:.0f} s old and its "
                               "peer plane does not answer", done)

    def drop(self, origin: str, why: str) -> None:
        """``origin`` left (unmounted, restarted) or its changes are all in the backing."""
        with self._lock:
            h = self.held.pop(origin, None)
        if h is not None:
            shutil.rmtree(h.dir, ignore_errors=True)
            log.info("replicas: dropped what this node held for %s (%s)", origin, why)

    def close(self) -> None:
        """At unmount: the replicas held go (their origins copy to another node); a takeover
        still running keeps its directory, which ``acpfs recover`` removes when done."""
        with self._lock:
            running = {o for o, t in self.takeovers.items() if t["state"] != "done"}
            held, self.held = self.held, {}
        for origin, h in held.items():
            if origin in running:
                log.warning("replicas: unmounting while the changes of node %s are persisted "
                            "from %s, or failed to be; that directory stays (acpfs recover, log "
                            "%s)", origin, h.dir, self._log(origin))
            else:
                shutil.rmtree(h.dir, ignore_errors=True)

    def status(self) -> dict:
        with self._lock:
            return {"held": {o: {"bytes": h.bytes, "pending": len(h.pending()),
                                 "applied_seq": h.applied}
                             for o, h in self.held.items()},
                    "held_bytes": self.used(), "budget": self.budget,
                    "received_bytes": self.received_bytes, "refused_batches": self.refused,
                    "takeovers": {o: dict(t) for o, t in self.takeovers.items()}}

    # -- takeover ---------------------------------------------------------------------------
    def take_over(self, origin: str, why: str, done: Callable[[str], None]) -> bool:
        """Persist what ``origin`` left here, in a thread (``acpfs recover``); ``done(origin)``
        once it ended. False if nothing is pending for it (dropped)."""
        with self._lock:
            h = self.held.get(origin)
            if h is None or origin in self.takeovers:
                return False
            if not h.pending():
                pending = False
            else:
                pending = True
                h.write_cache_dir()
                self.takeovers[origin] = {"since": time.time(), "state": "running",
                                          "changes": len(h.pending()), "bytes": h.bytes}
        if not pending:
            self.drop(origin, "nothing of it was left unsaved")
            return False
        log.warning("replicas: node %s is gone (%s) with %d changes not persisted; persisting "
                    "them from this node's replica, in its order (acpfs recover, log %s)",
                    origin, why, self.takeovers[origin]["changes"], self._log(origin))
        threading.Thread(target=self._run, args=(origin, h, done), daemon=True,
                         name=f"acpfs-takeover-{origin}").start()
        return True

    def _log(self, origin: str) -> str:
        return os.path.join(self.top, f"{origin}.log")

    def _run(self, origin: str, h: Held, done: Callable[[str], None]) -> None:
        cmd = [sys.executable, "-m", "acpfs", "recover", "--cache-dir", h.dir,
               "--log-file", self._log(origin), *self.recover_args]
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("ACPFS_")}
            out = self._log(origin) + ".out"
            with open(out, "w") as f:   # its own session: a signal to the holder is not its
                r = subprocess.run(cmd, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
            with open(out) as f:
                lines = f.read().strip().splitlines()
            ok, said = r.returncode == 0, (lines or [""])[-1]
        except OSError as e:
            ok, said = False, str(e)
        with self._lock:
            t = self.takeovers[origin]
            t.update(state="done" if ok else "failed", ended=time.time(), said=said)
            if ok:
                self.held.pop(origin, None)
        if ok:
            log.warning("replicas: every change node %s left unsaved is persisted (%d changes)",
                        origin, t["changes"])
        else:
            log.error("replicas: persisting what node %s left failed: %s; its replica stays in "
                      "%s (run acpfs recover --cache-dir %s with this backing)", origin, said,
                      h.dir, h.dir)
        done(origin)


def locked(path: str) -> bool:
    """Whether a daemon holds the lock file ``path`` (process.lock_cache_dir)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def answers(address: str) -> bool:
    """Whether a peer plane accepts a connection at ``address`` within a second."""
    if not address:
        return False
    try:
        host, port = parse_address(address, "peer address")
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except (OSError, ValueError):
        return False
