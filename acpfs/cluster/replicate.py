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
``replicated(no)`` tells a waiter (``--replica-wait``) whether entry ``no`` is held.
"""

from __future__ import annotations

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
from .replicas import APPLIED, ENTRY, RECORD, RESET

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
            self._entries.append(out)
            self._lock.notify_all()
            return out.no

    def reset(self) -> None:
        with self._lock:
            for e in self._entries:
                self._free(e)
            self._entries.clear()
            self._keys.clear()
            self._no += 1
            self._entries.append(Out(self._no, RESET, 0.0, b""))
            self._lock.notify_all()

    def applied(self, seq: int) -> None:
        with self._lock:
            self.applied_seq = seq
            for e in self._entries:
                if e.content is not None and 0 < e.seq <= seq:
                    self._free(e)
            self._no += 1
            self._entries.append(Out(self._no, APPLIED, 0.0, seq.to_bytes(8, "little"), seq=seq))
            self._lock.notify_all()

    def _free(self, e: Out) -> None:
        if e.content is not None:
            self._keys.pop(tuple(self.store.ref(e.content)), None)
            self.store.drop(e.content)
            e.content = None

    # -- status and waiters -----------------------------------------------------------------
    def replicated(self, no: int) -> bool:
        return self.acked >= no

    async def wait_copied(self) -> None:
        """``--replica-wait``: until the holder holds every entry numbered so far; at once
        where no live node can hold them (this node is alone: status shows what is owed)."""
        no = self.position()
        delay = 0.001
        while not self.replicated(no) and self.choose() is not None:
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
            return {"position": self._no, "acked": self.acked, "owed_age_s": round(time.time() - owed[0].made, 3) if owed else 0.0,
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
        """The holder: the current one while it is live, else the highest rendezvous hash."""
        live = self.holders()
        if self.holder in live:
            return self.holder
        if not live:
            return None
        return max(live, key=lambda p: hashlib.sha256(
            f"{self.instance}/{p[0]}".encode()).digest())

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (not self._entries or self._entries[-1].no <= self.acked):
                    self._lock.wait(1.0)
                if self._stop:
                    return
            holder = self.choose()
            if holder is None:
                self._failed(ALONE)
                continue
            if holder != self.holder:
                with self._lock:
                    self.holder, self.acked = holder, 0   # everything since the cut-back
                log.info("replicas: this node's unsaved changes are copied to %s (%s)",
                         holder[1], holder[0])
            batch = self._batch()
            try:
                held, why = self.remote.replicate(holder[1], self.instance, batch[0].no,
                                                  self._body(batch), self._length(batch))
            except PeerError as e:
                self._failed(str(e))
                continue
            with self._lock:
                if held - 1 > self.acked:
                    self.sent_bytes += sum(e.size for e in batch if e.no < held)
                self.acked = max(self.acked, held - 1) if held else 0
                if not held:
                    self.holder = None
            if why:
                self._failed(f"{holder[1]}: {why}")
                continue
            self._streak = 0
            if self.error:
                log.info("replicas: copying to %s again", holder[1])
                self.error = ""

    def _failed(self, why: str) -> None:
        if why != self.error:
            log.log(logging.INFO if why == ALONE else logging.WARNING,
                    "replicas: this node's unsaved changes cannot be copied to a peer: %s "
                    "(retrying, every %.0f s at most)", why, RETRY_MAX)
        self.error = why
        self.failures += 1
        self._streak += 1
        with self._lock:
            self._lock.wait(min(RETRY * 2 ** (self._streak - 1), RETRY_MAX))

    def _batch(self) -> list[Out]:
        """The entries after ``acked``, from the last cut-back on for a new holder, up to
        BATCH bytes of content."""
        with self._lock:
            # the list starts with a RESET: a new holder (acked 0) gets everything from it
            todo = [e for e in self._entries if e.no > self.acked]
            out, total = [], 0
            for e in todo:
                if out and total + e.size > BATCH:
                    break
                out.append(e)
                total += e.size
            return out

    @staticmethod
    def _length(batch: list[Out]) -> int:
        return sum(ENTRY.size + len(e.payload) + (e.size if e.content is not None else 0)
                   for e in batch)

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

