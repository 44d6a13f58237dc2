"""The control interface: read-only extended attributes under ``user.acpfs.``.

``acpfs status`` and ``acpfs sync`` talk to a daemon only through these, so they need no
socket and work with ordinary permissions (``getfattr`` works too):

    user.acpfs.state    any file or directory: dirty | flushing | persisted | error: <reason>
    user.acpfs.seq      any path: {"seq": N, "open_dirty": K}; the path is durable once the
                        mount's "applied_seq" reaches N (K files under it are still open
                        with unsaved data, and are saved at their last close)
    user.acpfs.status   mount root: the status document (schema in docs/status.md)
    user.acpfs.progress mount root: the part of it ``acpfs sync`` and ``umount`` poll while
                        they wait (``progress``): none of it grows with the files cached
                        or queued, as the whole document's counts do
    user.acpfs.files    mount root: files not yet persisted, with their state, sorted by
                        path: the first page of a listing made at that moment; its "next"
                        names the attribute of the next page, ``user.acpfs.files.<listing>.
                        <offset>``, until "next" is null (``Listings``; an xattr value is at
                        most 64 KiB, a listing of 100,000 long paths is megabytes)
    user.acpfs.peers    mount root: the status's ``peers`` (global order) with every other
                        node's record, paged as the files listing (``user.acpfs.peers.<listing>.
                        <offset>``): the status lists only the records that fit in it
    user.acpfs.preload  a regular file: reading it loads the file into the cache (``acpfs
                        preload``); ENOSPC when the cache cannot hold it

The status document's keys are stable within ``"version": 1``; keys may be added, never
renamed or removed. Users other than root and the mount's owner get no file names
(``hide_names``; docs/status.md).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..config import Options
from ..node import OpKind, OpState, node_path
from ..store.api import status_of

if TYPE_CHECKING:
    from ..cache.cache import Cache
    from ..flusher.flusher import Flusher
    from ..node import Node
    from .writethrough import WriteThrough

PREFIX = b"user.acpfs."
STATE = b"user.acpfs.state"
SEQ = b"user.acpfs.seq"
STATUS = b"user.acpfs.status"
PROGRESS = b"user.acpfs.progress"
FILES = b"user.acpfs.files"
PEERS = b"user.acpfs.peers"
PRELOAD = b"user.acpfs.preload"   # a file: read it into the cache; {"size": N, "cached": true}
STATUS_VERSION = 1
PAGE_BYTES = 60000     # a page of the files listing: an xattr value is at most 64 KiB
LISTED = 20            # paths in each of the recovery's lists in the status (the log has all)


@dataclasses.dataclass
class MountInfo:
    """What the status document tells of the mount beside its parts' own status: the options
    it was mounted with (``opts``, whole) and the facts of this daemon's run."""
    opts: Options
    recovery: dict | None = None   # what this daemon recovered from a dead one (recovery.py)
    # paths the recovery kept aside -> the seq of their publish (Recovered.aside_seqs)
    recovery_aside: dict[str, int] = dataclasses.field(default_factory=dict)
    # the kernel's passthrough state (passthrough.Kernel.state), None where not asked for
    passthrough: Callable[[], dict] | None = None
    # where the content store lives and what bounds its RAM (daemon.process.store_place)
    store_place: dict = dataclasses.field(default_factory=dict)
    # whether WRITEs reach the store by the C hook (fastwrite.state), None where not asked for
    fast_write: Callable[[], dict] | None = None
    # GETATTR and GETXATTR answered below Python (fuse/attrtable.py)
    attr_table: Callable[[], dict] | None = None
    # FUSE requests the daemon handled, by kind (fuse/operations.py): what passthrough leaves to it
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # uncached files the kernel reads from the backing file (coldreads.ColdReads.status)
    cold_reads: Callable[[], dict] | None = None
    # where lookups and opens ask the backing (backcalls.BackingCalls.status)
    backing_calls: Callable[[], dict] | None = None
    # OPEN, FLUSH and RELEASE answered without a coroutine (fastwrite.at_once_state)
    at_once: Callable[[], dict] | None = None
    # the cycle collector's collections and when they ran (daemon/collector.py)
    collector: Callable[[], dict] | None = None
    # idle CPUs polling while requests arrive (fastwrite.idle_poll_state, --idle-poll)
    idle_poll: Callable[[], dict] | None = None
    # the peer plane (--peers-listen; core/peerreads.PeerReads.status): why it is off, if so
    peer_plane: Callable[[], dict] | None = None
    replicas: Callable[[], dict] | None = None   # daemon/replication.py, with the peer plane
    metrics: str | None = None   # where the Prometheus endpoint listens (metrics_http.py)
    pid: int = dataclasses.field(default_factory=os.getpid)
    owner: int = dataclasses.field(default_factory=os.getuid)   # the mount's owner
    started: float = dataclasses.field(default_factory=time.time)


def get(flusher: Flusher, info: MountInfo, node: Node, name: bytes, trusted: bool = True,
        wt: WriteThrough | None = None) -> bytes:
    """The value of control attribute ``name`` of ``node``. ``trusted``: the caller is root or
    the mount's owner; others get no file names (the pending list is refused, the status
    document has its paths left out: ``hide_names``). ``wt``: the mount's write-through, for
    its counters."""
    cache = flusher.cache
    if name == STATE:
        return cache.files.state_of(node).encode()
    if name == SEQ:   # ``acpfs sync`` and ``umount`` are about to wait: no giving way till then
        flusher.give_way.waited_for(flusher.oplog.seq)
        seq, open_dirty = cache.files.subtree_seq(node)
        return json.dumps({"seq": seq, "open_dirty": open_dirty}).encode()
    if node is cache.inodes.root:
        if name == STATUS:
            doc = status(flusher, info, wt)
            return fitted(doc if trusted else hide_names(doc))
        if name == PROGRESS:
            doc = progress(flusher)
            return json.dumps(doc if trusted else hide_names(doc)).encode()
        if name == FILES or name.startswith(FILES + b"."):
            if not trusted:
                raise OSError(errno.EACCES, "the pending files are listed to root and the "
                                            "mount's owner only")
            if name == FILES:
                return listings.start(pending_files(cache))
            return listings.page(name[len(FILES) + 1:])
        if name == PEERS or name.startswith(PEERS + b"."):
            if name != PEERS:
                return peer_listings.page(name[len(PEERS) + 1:])
            if flusher.order is None:
                raise OSError(errno.ENODATA, "global order is off: no node records")
            doc = flusher.order.status()
            records = doc.pop("peers")
            if not trusted and doc.get("held"):
                doc["held"] = {**doc["held"], "path": HIDDEN}
            return peer_listings.start(records, {"doc": doc})
    raise OSError(errno.ENODATA, "no such attribute")


class Listings:
    """Listings read page by page (``attr``.<listing>.<offset>), each page's entries under
    ``key``: the pending files, the node records. A listing is taken whole when its first
    page is asked for, so its pages agree with each other however the mount changes in
    between; the newest few are kept, each for ``KEEP`` seconds after its last page was
    read."""
    KEEP = 60.0
    MAX = 4

    def __init__(self, attr: bytes, key: str) -> None:
        self.attr, self.key = attr, key
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    def start(self, files: list[dict[str, Any]], first: dict[str, Any] | None = None) -> bytes:
        """The first page of a new listing of ``files``; ``first``: more keys of that page."""
        token = secrets.token_hex(4)
        now = time.monotonic()
        with self._lock:
            for t, (used, _) in list(self._kept.items()):
                if now - used > self.KEEP:
                    del self._kept[t]
            while len(self._kept) >= self.MAX:
                del self._kept[min(self._kept, key=lambda t: self._kept[t][0])]
            self._kept[token] = (now, files)
        return self._page(token, files, 0, first or {})

    def page(self, rest: bytes) -> bytes:
        try:
            token, offset = rest.decode().split(".")
            start = int(offset)
        except ValueError:
            raise OSError(errno.ENODATA, "no such attribute") from None
        with self._lock:
            kept = self._kept.get(token)
            if kept is None:
                raise OSError(errno.EAGAIN, f"this listing of {self.key} is gone (older "
                                            f"than {self.KEEP:.0f} s): start again")
            self._kept[token] = (time.monotonic(), kept[1])
        return self._page(token, kept[1], start, {})

    def _page(self, token: str, files: list[dict[str, Any]], start: int,
              first: dict[str, Any]) -> bytes:
        """The entries from ``start`` that fit in ``PAGE_BYTES`` (at least one)."""
        extra = json.dumps(first, separators=(",", ":"))[1:-1]
        out, size, i = [], 200 + len(extra), start
        while i < len(files):
            one = json.dumps(files[i], separators=(",", ":"))
            if out and size + len(one) + 1 > PAGE_BYTES:
                break
            out.append(one)
            size += len(one) + 1
            i += 1
        nxt = (self.attr + b".%s.%d" % (token.encode(), i)).decode() if i < len(files) else None
        head = json.dumps({"total": len(files), "offset": start, "next": nxt,
                           "truncated": False}, separators=(",", ":"))
        return (head[:-1] + (f",{extra}" if extra else "") + f',"{self.key}":['
                + ",".join(out) + "]}").encode()


listings = Listings(FILES, "files")
peer_listings = Listings(PEERS, "peers")


HIDDEN = "(hidden: readable by root and the mount's owner)"


def fitted(doc: dict[str, Any]) -> bytes:
    """The status document as an xattr value, at most PAGE_BYTES: where the other nodes'
    records do not fit (hundreds of nodes), the first of them that do, with ``peers_total``
    saying how many there are (all of them: ``user.acpfs.peers``)."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    pe = doc.get("peers")
    if len(data) <= PAGE_BYTES or not pe or not pe["peers"]:
        return data
    listed, pe = pe["peers"], dict(pe)
    doc = {**doc, "peers": pe}
    pe["peers_total"], keep = len(listed), len(listed)
    while len(data) > PAGE_BYTES and keep:
        keep //= 2
        pe["peers"] = listed[:keep]
        data = json.dumps(doc, separators=(",", ":")).encode()
    return data


def recovery_status(info: MountInfo, applied: int) -> dict[str, Any] | None:
    """What this daemon recovered: its counts, and the first LISTED paths of each list with
    ``<list>_total`` (thousands of files can be kept aside; the log names every one)."""
    rec = info.recovery
    if rec is None:
        return None
    # content kept aside by the recovery lands like any change: pending until applied
    lists = {"lost_open_files": rec["lost_open_files"], "kept_aside": rec["kept_aside"],
             "aside_pending": [p for p, seq in info.recovery_aside.items() if seq > applied]}
    out = dict(rec)
    for key, paths in lists.items():
        out[key], out[f"{key}_total"] = paths[:LISTED], len(paths)
    return out


def hide_names(doc: dict[str, Any]) -> dict[str, Any]:
    """The status document (or the progress document) without the names of files, for
    other users (docs/status.md)."""
    for e in doc["errors"]:
        e["path"] = HIDDEN
    if "conflicts" in doc:
        doc["conflicts"]["recent"] = []
    if doc.get("recovery"):
        doc["recovery"] = {**doc["recovery"], "lost_open_files": [], "kept_aside": [],
                           "aside_pending": []}
    held = (doc.get("peers") or {}).get("held")
    if held:
        held["path"] = HIDDEN
    return doc


def status(fl: Flusher, info: MountInfo, wt: WriteThrough | None = None) -> dict[str, Any]:
    """The status document (docs/status.md), on the trio thread like every request, or
    where no request runs (the drain): each owner's part (op log, flusher, files, store,
    write-through), taken together under the op log's lock so that they agree."""
    cache, oplog = fl.cache, fl.oplog
    now = time.time()
    with oplog.lock:
        log_part = oplog.status()
        fl_part = fl.status()
        files = cache.files.status()
        admitted = cache.admission.status()
        store = status_of(cache.store)
    head_since = log_part.pop("head_since")
    oldest = min([t for t in (files.pop("dirty_since"), head_since) if t is not None],
                 default=None)
    recovery = recovery_status(info, log_part["queue"]["applied_seq"])
    flushing = {**log_part.pop("flushing"), "in_flight": fl_part.pop("in_flight")}
    return {
        "version": STATUS_VERSION,
        "mountpoint": info.opts.mountpoint,
        "backing": info.opts.backing,
        "pid": info.pid,
        "instance": cache.backing.instance,
        "backing_reopened": {"count": cache.backing.reopened, "last": cache.backing.last_reopen},
        "cache_dir": info.opts.cache_dir,
        "log_file": info.opts.log_file,
        "uptime_s": round(now - info.started, 1),
        "options": info.opts.as_status(),
        "cache": {**store, **info.store_place, "cached_files": files["cached_files"],
                  "writers_passed_through": files["writers_passed_through"],
                  "writer_opens": admitted},
        "dirty": files["dirty"],
        "flushing": flushing,
        **log_part,
        **fl_part,
        "write_through": wt.status() if wt is not None else {"files": 0, "bytes": 0},
        "oldest_dirty_age_s": None if oldest is None else round(now - oldest, 1),
        "recovery": recovery,
        "fast_write": info.fast_write() if info.fast_write is not None else
        {"on": False, "why_not": "not asked for"},
        "passthrough": info.passthrough() if info.passthrough is not None else
        {"on": False, "why_not": "not asked for"},
        "requests": dict(sorted(info.requests.items())),
        "answered_in_c": info.attr_table() if info.attr_table is not None else
        {"on": False, "why_not": "not asked for"},
        "cold_reads": info.cold_reads() if info.cold_reads is not None else
        {"files": 0, "opens": 0, "opened": 0, "refused": 0, "kept": 0, "keeping": 0, "fetched_bytes": 0},
        "backing_calls": info.backing_calls() if info.backing_calls is not None else
        {"where": "threads", "fstype": None, "inline": 0, "threaded": 0},
        "at_once": info.at_once() if info.at_once is not None else {"on": False},
        "kernel_held": cache.kernel.held_state(),
        "collector": info.collector() if info.collector is not None else {"on": False},
        "idle_poll": info.idle_poll() if info.idle_poll is not None else
        {"on": False, "why_not": "not asked for"},
        "peer_plane": info.peer_plane() if info.peer_plane is not None else
        {"on": False, "why_not": "not asked for (--peers-listen)"},
        "replicas": info.replicas() if info.replicas is not None else {"on": False},
        "metrics": info.metrics,
    }


def progress(fl: Flusher) -> dict[str, Any]:
    """The progress document (docs/status.md, "Progress"): the keys of the status document
    that a wait for durability shows, each with the status's value, and nothing whose cost
    grows with the files cached or queued. ``acpfs sync`` polls it every 20 ms at first:
    the whole document, counted over every file, took the interpreter from the flusher it
    was waiting for (docs/benchmarks.md, "Files persisted per second")."""
    oplog = fl.oplog
    with oplog.lock:
        queue = {"pending_ops": len(oplog.queue), "applied_seq": oplog.applied_seq,
                 "last_seq": oplog.seq}
        flushing = {"bytes": oplog.queued_bytes}
        errors = fl.errors()
        held = fl.order.held if fl.order is not None else None
    return {"version": STATUS_VERSION, "queue": queue, "flushing": flushing,
            "flush_rate_bytes_per_s": round(fl.rate()), "errors": errors,
            "peers": None if fl.order is None else {"held": None if held is None else dict(held)}}


def pending_files(cache: Cache) -> list[dict[str, Any]]:
    """Every file of the mount not yet persisted: dirty, or queued; sorted by path."""
    out = []
    seen = set()
    for node in list(cache.files.dirty_nodes):
        seen.add(node.ino)
        out.append(node)
    with cache.oplog.lock:
        queue = list(cache.oplog.queue)
    for op in queue:
        if op.kind == OpKind.PUBLISH and op.node.ino not in seen and op.state != OpState.VOID:
            seen.add(op.node.ino)
            out.append(op.node)
    files = [{"path": node_path(n), "state": cache.files.state_of(n), "size": n.size} for n in out]
    files.sort(key=lambda f: f["path"])
    return files
