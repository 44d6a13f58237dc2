"""Sending this node's unsaved changes to another node's RAM (``--replicas 1``; the other
side: replicas.py, docs/design.md, "Replicas of unsaved changes").

The op log hands every journal record to ``Replicator.add`` as it journals it (the FUSE
thread, the op log's lock held: nothing here blocks), with the content the record names (a
reference taken with ``Store.share``, so its bytes stay as they are), and says when its
journal is cut back (``reset``) and what the flusher applied (``applied``). A thread of
its own (``acpfs-replicate``) sends them, in order, to the holder: the live peer with a
plane that rendezvous hashing picks for this node (so that replicas spread), as long as it
stays live; a new holder is sent everything since the last cut-back.

Owns the entries since the last cut-back (``_entries``: numbered, with their content
references until the record is applied or the journal cut back) and what the holder
acknowledged (``acked``); ``_lock`` guards them (a Condition the thread sleeps on).
``copied(no)`` tells a waiter (``--replica-wait``) whether entry ``no`` is held.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

import trio

from ..oplog.journal import Record
from .remote import PeerError, Remote
from .replicas import APPLIED, ENTRY, APPLIED_RECORD, RECORD, RESET

log = logging.getLogger(__name__)

BATCH = 256 << 20     # content bytes per request at most (one larger entry goes alone)
RETRY = 1.0           # s before a refused or failed batch is sent again, doubled each
RETRY_MAX = 30.0      # time it fails again in a row (a budget stays full a while), up to this
ALONE = "no live peer with a peer plane to hold replicas"


@dataclasses.dataclass
class Out:
    no: int
    kind: int
    stamp: float
    payload: bytes
    content: Any = None   # a Store reference (shared) while it may still be sent
    size: int = 0
    reuse: int = 0        # the entry whose content this one shares
    seq: int = 0
    made: float = dataclasses.field(default_factory=time.time)


class Replicator:
    def __init__(self, store: Any, remote: Remote, instance: str,
                 holders: Callable[[], list[tuple[str, str]]]) -> None:
        self.store = store          # the content store (store/api.py: share, ref, source, drop)
        self.remote = remote
        self.instance = instance
        self.holders = holders      # (instance, address) of the live peers with a plane
        self._lock = threading.Condition()
        self._entries: list[Out] = []
        self._no = 0                # the last entry numbered
        self._keys: dict[tuple[int, ...], int] = {}   # content refs -> entry holding them
        self.acked = 0              # (lock) the holder holds every entry up to this one
        self.applied_seq = 0        # (lock) the op log's: records up to it are in the backing
        self.holder: tuple[str, str] | None = None
        self.sent_bytes = 0
        self.failures = 0
        self._streak = 0            # failures in a row (the thread's)
        self.error = ""             # why the last batch failed, "" if it did not
        self._stop = False
        self._freed = False         # (lock) content freed since the last failure (room made)
        self._with_content: collections.deque[Out] = collections.deque()   # (lock) op records
        self._shunned: dict[str, float] = {}   # holder instance -> not chosen until then
        self.reset()   # the list always starts with a RESET: a new holder starts from it
        self.thread = threading.Thread(target=self._run, name="acpfs-replicate", daemon=True)

    # -- the op log's side (its lock held) --------------------------------------------------
    def add(self, record: Record, content: Any, stamp: float) -> int:
        with self._lock:
            self._no += 1
            out = Out(self._no, RECORD, stamp, record.encode(), seq=record.seq)
            if content is not None and record.size:
                key = tuple(self.store.ref(content))
                if key in self._keys:
                    out.reuse = self._keys[key]
                else:
                    out.content, out.size = self.store.share(content), record.size
                    self._keys[key] = out.no
                    if record.seq:
                        self._with_content.append(out)
            self._entries.append(out)
            if not self.error:   # a failing sender waits for room or its retry (_failed)
                self._lock.notify_all()
            return out.no

    def reset(self) -> None:
        with self._lock:
            for e in self._entries:
                self._free(e)
            self._entries.clear()
            self._keys.clear()
            self._with_content.clear()
            self._no += 1
            self._entries.append(Out(self._no, RESET, 0.0, b""))
            self._freed = True
            self._lock.notify_all()

    def applied(self, seq: int) -> None:
        with self._lock:
            self.applied_seq = seq
            while self._with_content and self._with_content[0].seq <= seq:   # seq order
                self._free(self._with_content.popleft())
                self._freed = True
            self._no += 1
            self._entries.append(Out(self._no, APPLIED, 0.0, seq.to_bytes(8, "little"), seq=seq))
            self._lock.notify_all()

    def _free(self, e: Out) -> None:
        if e.content is not None:
            self._keys.pop(tuple(self.store.ref(e.content)), None)
            self.store.drop(e.content)
            e.content = None

    # -- status and waiters -----------------------------------------------------------------
    def copied(self, no: int) -> bool:
        """Entry ``no`` is held by the holder, or the journal was cut back since (all of it
        in the backing)."""
        with self._lock:
            return self.acked >= no or self._entries[0].no > no

    async def wait_copied(self) -> None:
        """``--replica-wait``: until the holder holds every entry numbered so far, or all of
        it is in the backing; at once where no live node can hold it, or copying fails (the
        holder has no room, refuses): status shows what is owed, and why."""
        no = self.position()
        delay = 0.001
        while not self.copied(no) and not self.error and self.choose() is not None:
            await trio.sleep(delay)
            delay = min(delay * 2, 0.02)

    def position(self) -> int:
        with self._lock:
            return self._no

    def status(self) -> dict:
        with self._lock:
            # not held there, and not in the backing either
            owed = [e for e in self._entries if e.no > self.acked and e.kind == RECORD
                    and not 0 < e.seq <= self.applied_seq]
            return {"position": self._no, "acked": max(self.acked, self._entries[0].no - 1),
                    "owed_age_s": round(time.time() - owed[0].made, 3) if owed else 0.0,
                    "holder": self.holder[1] if self.holder else None,
                    "holder_instance": self.holder[0] if self.holder else None,
                    "owed_records": len(owed), "owed_bytes": sum(e.size for e in owed),
                    "sent_bytes": self.sent_bytes, "failures": self.failures,
                    "error": self.error or None}

    # -- the thread -------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        with self._lock:
            for e in self._entries:
                self._free(e)

    def choose(self) -> tuple[str, str] | None:
        """The holder: the current one while it is live, else the highest rendezvous hash
        of those not shunned (one that said it took this node over)."""
        now = time.monotonic()
        live = [p for p in self.holders() if self._shunned.get(p[0], 0.0) < now]
        if self.holder in live:
            return self.holder
        if not live:
            return None
        return max(live, key=lambda p: hashlib.sha256(
            f"{self.instance}/{p[0]}".encode()).digest())

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and self._entries[-1].no <= self.acked:
                    self._lock.wait(1.0)
                if self._stop:
                    return
            try:
                self._send()
            except Exception as e:   # never the end of copying: said, and tried again
                log.exception("replicas: copying this node's changes failed")
                self._failed(f"an error in this node: {e}")

    def _send(self) -> None:
        holder = self.choose()
        if holder is None:
            self._failed(ALONE)
            return
        if holder != self.holder:
            old = self.holder
            with self._lock:
                self.holder, self.acked = holder, 0   # everything since the cut-back
            log.info("replicas: this node's unsaved changes are copied to %s (%s)",
                     holder[1], holder[0])
            if old is not None:   # the old holder drops its copy: no stale one to take over
                self._forget(old)
        batch, length = self._batch()
        try:
            held, why = self.remote.replicate(holder[1], self.instance, batch[0].no,
                                              self._body(batch), length)
        except PeerError as e:
            self._failed(str(e))
            return
        finally:
            for e in batch:   # the batch's own references (_batch)
                if e.content is not None:
                    self.store.drop(e.content)
        with self._lock:
            if held - 1 > self.acked:
                self.sent_bytes += sum(e.size for e in batch if e.no < held)
            if held == 0:   # it took this node over: another holder, from the cut-back
                self._shunned[holder[0]] = time.monotonic() + 60.0
                self.holder, self.acked = None, 0
            elif held - 1 < self.acked:   # it lost entries it had: again from the cut-back
                self.acked = 0
            else:
                self.acked = held - 1
        if why:
            self._failed(f"{holder[1]}: {why}")
            return
        self._streak = 0
        if self.error:
            log.info("replicas: copying to %s again", holder[1])
            self.error = ""

    def _forget(self, old: tuple[str, str]) -> None:
        reset = ENTRY.pack(RESET, 0.0, 0, 0, 0)
        try:
            self.remote.replicate(old[1], self.instance, 1, iter([reset]), len(reset))
        except PeerError as e:
            log.info("replicas: the former holder %s keeps a copy it will drop: %s", old[1], e)

    def _failed(self, why: str) -> None:
        """Wait before the next try: 1 s where no node is live, else doubling from 1 s to
        30 s while it fails again, or until content is freed (a holder short of room may
        take what follows)."""
        if why != self.error:
            log.log(logging.INFO if why == ALONE else logging.WARNING,
                    "replicas: this node's unsaved changes cannot be copied to a peer: %s "
                    "(retrying, every %.0f s at most)", why, RETRY_MAX)
        self.error = why
        self.failures += 1
        self._streak += 1
        wait = RETRY if why == ALONE else min(RETRY * 2 ** (self._streak - 1), RETRY_MAX)
        deadline = time.monotonic() + wait
        with self._lock:
            self._freed = False
            while not self._stop and not self._freed and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)

    def _batch(self) -> tuple[list[Out], int]:
        """The entries after ``acked`` (from the cut-back on for a new holder: the list starts
        with its RESET), up to BATCH bytes of content, each content with a reference of the
        batch's own (the op log may drop the entry's meanwhile); and the body's length. A
        record of an op already applied travels as such, with no content."""
        with self._lock:
            out, total, length = [], 0, 0
            for e in self._entries:
                if e.no <= self.acked:
                    continue
                if out and total + e.size > BATCH:
                    break
                content = self.store.share(e.content) if e.content is not None else None
                kind = APPLIED_RECORD if e.kind == RECORD and 0 < e.seq <= self.applied_seq \
                    else e.kind
                out.append(dataclasses.replace(e, kind=kind, content=content))
                total += e.size
                length += ENTRY.size + len(e.payload) + (e.size if content is not None else 0)
            return out, length

    def _body(self, batch: list[Out]) -> Iterator[bytes]:
        for e in batch:
            content = e.content
            n = e.size if content is not None else 0
            yield ENTRY.pack(e.kind, e.stamp, len(e.payload), n, e.reuse) + e.payload
            if n:
                with self.store.source(content, n) as (fd, runs):
                    for _off, at, length in runs:
                        yield from _pieces(fd, at, length)


def _pieces(fd: int, at: int, length: int, piece: int = 1 << 20) -> Iterator[bytes]:
    end = at + length
    while at < end:
        data = os.pread(fd, min(piece, end - at), at)
        if not data:
            raise OSError("a replica's content ended early")
        yield data
        at += len(data)
