"""Prometheus metrics: the status documents of mounts rendered in the text exposition format
(version 0.0.4), for the daemon's endpoint (``--metrics``, metrics_http.py) and for
``acpfs status --prometheus`` (node_exporter's textfile collector) alike.

Owns the names, types and help of the metric families (``FAMILIES``), which field of the
status document (docs/status.md) each comes from, and the format: ``# HELP`` and ``# TYPE``
once per family, then one sample per line, ``name{label="value",...} value``, label values
escaped (backslash, double quote, newline). Every series has the label ``mountpoint``, so
the families of several mounts go in one text, and the endpoint and the textfile agree. No
file names are ever exported: the text may be read by anyone who can reach the endpoint.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

from .health import HEALTHY, health

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help); the order of the text
FAMILIES: dict[str, tuple[str, str]] = {
    "acpfs_up": ("gauge", "1 if the mount's daemon answers, 0 if the mount is stale (its "
                 "daemon is gone)"),
    "acpfs_healthy": ("gauge", "1 if 'acpfs status --check' (without --max-unsaved-age) would "
                      "say OK, 0 if degraded or down"),
    "acpfs_info": ("gauge", "the mount's backing, daemon instance and data path, value 1"),
    "acpfs_uptime_seconds": ("gauge", "seconds since the daemon started"),
    "acpfs_cache_size_bytes": ("gauge", "RAM the cache may use (--cache-size)"),
    "acpfs_cache_used_bytes": ("gauge", "bytes of cached data, snapshots being flushed included"),
    "acpfs_cache_peak_used_bytes": ("gauge", "the most bytes ever cached since mount"),
    "acpfs_cached_files": ("gauge", "files with content in the cache"),
    "acpfs_dirty_bytes": ("gauge", "bytes of files changed since their last close"),
    "acpfs_dirty_files": ("gauge", "files changed since their last close"),
    "acpfs_flushing_bytes": ("gauge", "bytes of closed files queued or uploading to the backing"),
    "acpfs_flushing_files": ("gauge", "closed files queued or uploading to the backing"),
    "acpfs_uploads_in_flight": ("gauge", "uploads to the backing running now"),
    "acpfs_queued_operations": ("gauge", "changes not yet applied to the backing"),
    "acpfs_oldest_unsaved_seconds": ("gauge", "age of the oldest change not yet in the "
                                     "backing, 0 if none"),
    "acpfs_failing_operations": ("gauge", "operations on the backing failing now (retried)"),
    "acpfs_flusher_alive": ("gauge", "0 if the flusher thread died (nothing more is persisted)"),
    "acpfs_journal_ok": ("gauge", "0 if the crash journal cannot be written"),
    "acpfs_peers": ("gauge", "other nodes over the same backing, by state (global order)"),
    "acpfs_peer_holding": ("gauge", "1 while another node holds this node's changes back "
                           "(global order)"),
    "acpfs_peer_holding_seconds": ("gauge", "how long another node has held this node's "
                                   "changes back, 0 if none"),
    "acpfs_persisted_bytes_total": ("counter", "bytes of file versions published to the backing"),
    "acpfs_persisted_files_total": ("counter", "file versions published to the backing"),
    "acpfs_publish_errors_total": ("counter", "calls on the backing of the flusher that failed "
                                   "(each counted once, however often retried)"),
    "acpfs_retries_total": ("counter", "failed attempts of calls on the backing, each retried"),
    "acpfs_conflicts_total": ("counter", "changes that met another writer's in the backing, by "
                              "kind"),
    "acpfs_recovered_files_total": ("counter", "files recovered from a dead daemon's journal "
                                    "at mount"),
    "acpfs_recovered_operations_total": ("counter", "changes replayed from a dead daemon's "
                                         "journal at mount"),
    "acpfs_write_through_bytes_total": ("counter", "bytes written straight to the backing "
                                        "while the cache was full"),
    "acpfs_write_through_files_total": ("counter", "files written through to the backing "
                                        "while the cache was full"),
    "acpfs_backing_reopened_total": ("counter", "times the backing went away and was opened "
                                     "again"),
    "acpfs_requests_total": ("counter", "FUSE requests handled by the daemon, by kind"),
    "acpfs_requests_answered_in_c_total": ("counter", "FUSE requests the C extension answered "
                                           "from the attribute table, by kind"),
    "acpfs_writer_opens_total": ("counter", "opens for writing that could have been passed "
                                 "through, by decision (passed_through, unknown_size, no_room, "
                                 "over_size)"),
    "acpfs_cold_read_opens_total": ("counter", "opens of files not in the cache, read from the "
                                    "backing file by the kernel (passthrough) or the daemon"),
    "acpfs_requests_answered_at_once_total": ("counter", "LOOKUP, CREATE, UNLINK, OPEN, FLUSH, RELEASE, "
                                              "READ requests answered without a coroutine, by kind"),
    "acpfs_fetched_bytes_total": ("counter", "bytes copied from the backing into the cache: "
                                  "preloads and files kept after a read"),
    "acpfs_cold_read_files": ("gauge", "files not in the cache open for reading from the "
                              "backing file now"),
    "acpfs_cache_over_size_bytes": ("gauge", "bytes the cache holds past --cache-size (files "
                                    "written with passthrough that grew), 0 if none"),
    "acpfs_gc_collections_total": ("counter", "collections of the interpreter's cycle collector, "
                                   "by generation (young: automatic; full: run when the mount "
                                   "is quiet)"),
    "acpfs_gc_seconds_total": ("counter", "seconds the cycle collector stopped the daemon, by "
                               "generation"),
    "acpfs_gc_longest_seconds": ("gauge", "the longest the cycle collector stopped the daemon "
                                 "since start, by generation: requests waited that long"),
    "acpfs_idle_poll_holds_total": ("counter", "times the daemon asked idle CPUs to poll "
                                    "because requests began to arrive (--idle-poll)"),
    "acpfs_idle_poll_held_seconds_total": ("counter", "seconds idle CPUs were asked to poll "
                                           "instead of halting (--idle-poll)"),
    "acpfs_peer_fetched_bytes_total": ("counter", "bytes of files read from other nodes' RAM "
                                       "instead of the backing (--peers-listen)"),
    "acpfs_peer_fetched_files_total": ("counter", "files read from other nodes' RAM instead of "
                                       "the backing"),
    "acpfs_peer_fallbacks_total": ("counter", "opens that asked the other nodes and read the "
                                   "backing after all (none held the file, or one failed)"),
    "acpfs_peer_served_bytes_total": ("counter", "bytes this node served to other nodes from "
                                      "its cache"),
    "acpfs_peer_refused_requests_total": ("counter", "requests to this node's peer plane "
                                          "refused: unsigned, another secret, sent again"),
    "acpfs_peer_failed_peers": ("gauge", "peers whose last answer could not be used (their "
                                "files were read from the backing)"),
    "acpfs_replica_owed_bytes": ("gauge", "bytes of this node's unsaved changes not yet copied "
                                 "to another node (--replicas 1)"),
    "acpfs_replica_sent_bytes_total": ("counter", "bytes of this node's unsaved changes copied "
                                       "to another node"),
    "acpfs_replica_held_bytes": ("gauge", "bytes this node holds of other nodes' unsaved "
                                 "changes (--replica-budget)"),
    "acpfs_replica_received_bytes_total": ("counter", "bytes of other nodes' unsaved changes "
                                           "received"),
    "acpfs_replica_takeovers_total": ("counter", "dead nodes whose unsaved changes this node "
                                      "persisted from its replicas, or is persisting"),
    "acpfs_close_to_durable_seconds": ("histogram", "time from a file's last close (its "
                                       "snapshot queued) to that version durable in the backing"),
}
PEER_STATES = ("up", "idle", "expired", "left")

# the families that are one field of the document each
GAUGES = {
    "acpfs_uptime_seconds": "uptime_s",
    "acpfs_cache_size_bytes": "cache.limit_bytes",
    "acpfs_cache_used_bytes": "cache.used_bytes",
    "acpfs_cache_peak_used_bytes": "cache.peak_used_bytes",
    "acpfs_cached_files": "cache.cached_files",
    "acpfs_cache_over_size_bytes": "cache.over_limit_bytes",
    "acpfs_cold_read_files": "cold_reads.files",
    "acpfs_dirty_bytes": "dirty.bytes",
    "acpfs_dirty_files": "dirty.files",
    "acpfs_flushing_bytes": "flushing.bytes",
    "acpfs_flushing_files": "flushing.files",
    "acpfs_uploads_in_flight": "flushing.in_flight",
    "acpfs_queued_operations": "queue.pending_ops",
}
COUNTERS = {
    "acpfs_persisted_bytes_total": "persisted_since_mount.bytes",
    "acpfs_persisted_files_total": "persisted_since_mount.files",
    "acpfs_publish_errors_total": "errors_since_mount.calls",
    "acpfs_retries_total": "errors_since_mount.retries",
    "acpfs_write_through_bytes_total": "write_through.bytes",
    "acpfs_write_through_files_total": "write_through.files",
    "acpfs_backing_reopened_total": "backing_reopened.count",
    "acpfs_cold_read_opens_total": "cold_reads.opened",
    "acpfs_fetched_bytes_total": "cold_reads.fetched_bytes",
}

Sample = tuple[str, dict[str, str], float]   # (name with suffix, labels, value)


def render(docs: list[dict[str, Any]]) -> str:
    """The text of every family for these status documents (a stale mount's is
    ``{"mountpoint": ..., "stale": True}``); families without a series are left out."""
    by_family: dict[str, list[Sample]] = {name: [] for name in FAMILIES}
    for doc in docs:
        for family, sample in samples(doc):
            by_family[family].append(sample)
    lines = []
    for name, found in by_family.items():
        if not found:
            continue
        kind, text = FAMILIES[name]
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{n}{labels_text(labels)} {number(v)}" for n, labels, v in found)
    return "\n".join(lines) + "\n" if lines else ""


def samples(doc: dict[str, Any]) -> Iterator[tuple[str, Sample]]:
    """(family, sample) of one mount's status document. A key the document lacks (a daemon
    of an older version) leaves its series out rather than invent a value."""
    m = {"mountpoint": doc["mountpoint"]}

    def one(name: str, value: float | None, **labels: str) -> Iterator[tuple[str, Sample]]:
        if value is not None:
            yield name, (name, {**m, **labels}, value)
    if doc.get("stale"):
        yield from one("acpfs_up", 0)
        yield from one("acpfs_healthy", 0)
        return
    yield from one("acpfs_up", 1)
    yield from one("acpfs_healthy", int(healthy(doc)))
    yield from one("acpfs_info", 1, backing=doc["backing"], instance=doc["instance"],
                   store=doc["cache"]["store"], fsync=doc["options"]["fsync"],
                   passthrough="on" if field(doc, "passthrough.on") else "off")
    for name, key in GAUGES.items():
        yield from one(name, field(doc, key))
    yield from one("acpfs_oldest_unsaved_seconds", doc.get("oldest_dirty_age_s") or 0)
    yield from one("acpfs_failing_operations", len(doc["errors"]))
    yield from one("acpfs_flusher_alive", int(bool(doc["flusher_alive"])))
    yield from one("acpfs_journal_ok", int(not doc.get("journal_error")))
    yield from peer_gauges(doc, one)
    for name, key in COUNTERS.items():
        yield from one(name, field(doc, key))
    for kind, n in field(doc, "conflicts.by_kind", {}).items():
        yield from one("acpfs_conflicts_total", n, kind=kind)
    for kind, n in doc.get("requests", {}).items():
        yield from one("acpfs_requests_total", n, kind=kind)
    in_c = doc.get("answered_in_c") or {}
    for kind in ("getattr", "getxattr"):
        yield from one("acpfs_requests_answered_in_c_total", in_c.get(f"{kind}_answered", 0),
                       kind=kind)
    at_once = doc.get("at_once") or {}
    for kind in ("lookup", "create", "unlink", "open", "flush", "release", "read"):
        yield from one("acpfs_requests_answered_at_once_total",
                       (at_once.get(kind) or {}).get("answered", 0), kind=kind)
    for decision, n in field(doc, "cache.writer_opens", {}).items():
        yield from one("acpfs_writer_opens_total", n, decision=decision)
    collector = doc.get("collector") or {}
    if "full" in collector:   # (a daemon of an older version has none)
        for gen in ("young", "full"):
            yield from one("acpfs_gc_collections_total", collector[gen], generation=gen)
            yield from one("acpfs_gc_seconds_total", collector[f"{gen}_s"], generation=gen)
            yield from one("acpfs_gc_longest_seconds", collector[f"longest_{gen}_s"],
                           generation=gen)
    idle = doc.get("idle_poll") or {}
    if idle.get("on"):
        yield from one("acpfs_idle_poll_holds_total", idle["holds"])
        yield from one("acpfs_idle_poll_held_seconds_total", idle["held_s"])
    plane = doc.get("peer_plane") or {}
    if plane.get("on"):
        yield from one("acpfs_peer_fetched_bytes_total", plane["fetched_bytes"])
        yield from one("acpfs_peer_fetched_files_total", plane["fetched_files"])
        yield from one("acpfs_peer_fallbacks_total", plane["fallbacks"])
        yield from one("acpfs_peer_served_bytes_total", plane["served_bytes"])
        yield from one("acpfs_peer_refused_requests_total", plane["refused_requests"])
        yield from one("acpfs_peer_failed_peers", len(plane["failed_peers"]))
    yield from replica_samples(doc.get("replicas") or {}, one)
    recovery = doc.get("recovery") or {}
    yield from one("acpfs_recovered_files_total", recovery.get("files", 0))
    yield from one("acpfs_recovered_operations_total", recovery.get("replayed_ops", 0))
    if "close_to_durable_s" in doc:
        yield from histogram("acpfs_close_to_durable_seconds", doc["close_to_durable_s"], m)


def replica_samples(rep: dict[str, Any], one) -> Iterator[tuple[str, Sample]]:
    """Replicas sent (--replicas 1) and held for others (with the peer plane)."""
    sending = rep.get("sending")
    if sending:
        yield from one("acpfs_replica_owed_bytes", sending["owed_bytes"])
        yield from one("acpfs_replica_sent_bytes_total", sending["sent_bytes"])
    if "held_bytes" in rep:
        yield from one("acpfs_replica_held_bytes", rep["held_bytes"])
        yield from one("acpfs_replica_received_bytes_total", rep["received_bytes"])
        yield from one("acpfs_replica_takeovers_total", len(rep["takeovers"]))


def field(doc: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value at a dotted key of the document, or ``default``."""
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return default
        doc = doc[part]
    return doc


def peer_gauges(doc: dict[str, Any], one) -> Iterator[tuple[str, Sample]]:
    """The other nodes by state and what holds this one (none with --global-order off)."""
    peers = doc.get("peers")
    if peers is None:
        return
    for state in PEER_STATES:
        yield from one("acpfs_peers", sum(1 for p in peers["peers"] if p["state"] == state),
                       state=state)
    held = peers.get("held")
    yield from one("acpfs_peer_holding", int(held is not None))
    yield from one("acpfs_peer_holding_seconds",
                   max(0.0, time.time() - held["since"]) if held is not None else 0)


def histogram(name: str, h: dict[str, Any], labels: dict[str, str]) -> Iterator[tuple[str, Sample]]:
    """The ``_bucket`` (cumulative, ``le``), ``_count`` and ``_sum`` series of a histogram
    as ``Histogram.as_dict`` gives it."""
    for bound, n in h["buckets"]:
        yield name, (name + "_bucket", {**labels, "le": number(bound)}, n)
    yield name, (name + "_bucket", {**labels, "le": "+Inf"}, h["count"])
    yield name, (name + "_count", labels, h["count"])
    yield name, (name + "_sum", labels, h["sum"])


def healthy(doc: dict[str, Any]) -> bool:
    """What ``acpfs status --check`` says of the document, without --max-unsaved-age (its
    one rule, ``health.health``)."""
    return health(doc, None)[0] == HEALTHY


def labels_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in labels.items()) + "}"


def escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value or bound: integers without a point, +Inf/-Inf/NaN as Prometheus writes
    them."""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
