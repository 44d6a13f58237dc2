"""``acpfs status``: the status document of each mount shown as text, JSON, the pending files
or Prometheus text, ``--check`` (the health rule of ``daemon.health``, one line per mount)
and ``--watch``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .. import mounttable
from ..config import DEFAULT_WATCH_INTERVAL, age, format_size, safe
from ..daemon import health
from ..daemon.health import held_text
from ..errors import Failure, UsageError
from . import client, watch


def cmd_status(a: argparse.Namespace) -> int:
    """Every mount, or the one named. The one named being stale is a failure (exit 1, the
    ``gone`` line on stderr) after its document; in the list of every mount a stale one is
    a line of the report."""
    if a.max_unsaved_age is not None and not a.check:
        raise UsageError("--max-unsaved-age goes with --check")
    if a.check:
        if a.json or a.files or a.watch or a.prometheus:
            raise UsageError("--check prints one line per mount: not with --json, --files, "
                             "--watch or --prometheus")
        return check_status(a.mountpoint, a.max_unsaved_age)
    if a.watch:
        if a.prometheus:
            raise UsageError("--watch prints a line per interval: not with --prometheus")
        return watch_status(a)
    if a.interval is not None or a.count is not None:
        raise UsageError("--interval and --count go with --watch")
    if a.prometheus and (a.json or a.files):
        raise UsageError("--prometheus prints the metrics text: not with --json or --files")
    mounts = [mounttable.mount_of(a.mountpoint)] if a.mountpoint else mounttable.acpfs_mounts()
    docs = []
    for m in mounts:
        if client.is_stale(m):
            doc: dict[str, Any] = {"mountpoint": m, "stale": True}
        else:
            doc = client.read_status(m)
            if a.files:
                doc["files"] = client.read_files(m)
        docs.append(doc)
    if a.prometheus:
        from ..daemon.metrics import render
        sys.stdout.write(render(docs))
    elif a.json:
        print(json.dumps(docs[0] if a.mountpoint else docs, indent=2))
    elif not docs:
        print("no acpfs mounts")
    else:
        for doc in docs:
            print(render_status(doc))
    if a.mountpoint and docs[0].get("stale"):
        sys.stdout.flush()
        raise client.gone(a.mountpoint, docs[0]["mountpoint"])
    return 0


def watch_status(a: argparse.Namespace) -> int:
    """``status --watch``: rates of one mount, a line per interval, until interrupted."""
    if a.json or a.files:
        raise UsageError("--watch prints a line per interval: not with --json or --files")
    interval = DEFAULT_WATCH_INTERVAL if a.interval is None else a.interval
    if interval <= 0:
        raise UsageError("--interval must be more than 0")
    if a.count is not None and a.count < 1:
        raise UsageError("--count must be at least 1")
    if a.mountpoint:
        mount = client.live_mount(a.mountpoint)
    else:
        mounts = [m for m in mounttable.acpfs_mounts() if not client.is_stale(m)]
        if len(mounts) != 1:
            raise UsageError("--watch watches one mount: name it" + (
                f" ({', '.join(mounts[:5])})" if mounts else "; there is no live acpfs mount"))
        mount = mounts[0]
    try:
        return watch.watch(mount, interval, a.count)
    except KeyboardInterrupt:
        return 0   # the way to stop it


def render_peers(pe: dict[str, Any]) -> list[str]:
    live = [p for p in pe["peers"] if p["state"] in ("up", "idle")]
    lines = [f"  nodes      this one and {len(live)} other live nodes share the backing "
             f"(skew {pe['skew']:g}s, lease {pe['lease']:g}s)" if "peers_total" not in pe else
             f"  nodes      this one and {pe['peers_total']} other nodes share the backing, "
             f"{len(pe['peers'])} listed (skew {pe['skew']:g}s, lease {pe['lease']:g}s)"]
    if pe.get("error"):
        lines.append(f"  ERROR      node records: {pe['error']}")
    for p in pe["peers"][:20]:
        if p["state"] == "left":
            continue
        lag = f", frontier {p['frontier_lag']:.1f}s behind" if p["state"] == "up" else ""
        lines.append(f"    {p['state']:<8} {safe(p['node'])} ({p['instance']}): heartbeat "
                     f"{p['last_heartbeat']:.1f}s ago{lag}")
    if pe.get("held"):
        lines.append(f"  HELD       {held_text(pe['held'])}")
    return lines


def data_path(d: dict[str, Any]) -> str:
    """Who reads and writes cached files: the kernel (passthrough) or the daemon, and why."""
    pt = d.get("passthrough") or {}
    store = d["cache"].get("store", "pool")
    if pt.get("on"):
        w = d["cache"].get("writer_opens") or {}
        why = ", ".join(f"{n} {what}" for n, what in (
            (w.get("unknown_size"), "of new names"), (w.get("no_room"), "without room"),
            (w.get("over_size"), "while over its size")) if n)
        return (f"kernel passthrough into {store} ({pt.get('opens', 0)} opens passed through"
                + (f"; writers by the daemon: {why}" if why else "") + ")")
    return f"through the daemon, {store} ({pt.get('why_not') or 'passthrough not asked for'})"


def peer_plane_lines(pp: dict[str, Any]) -> list[str]:
    """The peer plane's lines (``--peers-listen``): none where it was not asked for."""
    if pp.get("address") is None:
        return []
    if not pp.get("on"):
        return [f"  peers      plane OFF at {pp['address']}: {pp.get('why_not')}; files are read "
                "from the backing alone"]
    lines = [f"  peers      serving at {pp['address']}: {format_size(pp['served_bytes'])} served, "
             f"{format_size(pp['fetched_bytes'])} fetched ({pp['fetched_files']} files; "
             f"{pp['fallbacks']} opens read the backing after asking)"
             + (f"; {pp['refused_requests']} requests REFUSED" if pp.get("refused_requests") else "")]
    lines += [f"  peer       {addr} failed: {why}" for addr, why in
              sorted((pp.get("failed_peers") or {}).items())[:4]]
    return lines


def replica_lines(rep: dict[str, Any]) -> list[str]:
    """Replicas: what this node sends (--replicas 1) and holds for others."""
    lines = []
    sending = rep.get("sending")
    if sending:
        owed = (f"{sending['owed_records']} changes ({format_size(sending['owed_bytes'])}) NOT "
                f"YET COPIED for {age(sending['owed_age_s'])}" if sending["owed_records"]
                else "every change copied")
        lines.append(f"  replicas   to {sending['holder'] or 'NO NODE'}: {owed}"
                     + (f"; {sending['error']}" if sending.get("error") else ""))
    if rep.get("held"):
        lines.append(f"  holding    {format_size(rep['held_bytes'])} of "
                     f"{format_size(rep['budget'])} for {len(rep['held'])} nodes' unsaved changes")
    for origin, t in sorted((rep.get("takeovers") or {}).items()):
        lines.append(f"  takeover   node {origin}: {t['changes']} changes, {t['state'].upper()}"
                     + (f": {t['said']}" if t.get("state") == "failed" else ""))
    return lines


def render_status(d: dict[str, Any]) -> str:
    if d.get("stale"):
        return f"{d['mountpoint']}  STALE: the daemon is gone; run 'acpfs umount {d['mountpoint']}'"
    c, di, fl, p = d["cache"], d["dirty"], d["flushing"], d["persisted_since_mount"]
    lines = [
        f"{d['mountpoint']}  (backing {d['backing']}, pid {d['pid']}, up {age(d['uptime_s'])})",
        f"  cache      {format_size(c['used_bytes'])} used of {format_size(c['limit_bytes'])} "
        f"(peak {format_size(c['peak_used_bytes'])}), {c['cached_files']} files cached"
        + (f"; OVER ITS SIZE by {format_size(c['over_limit_bytes'])} ({c['writers_passed_through']} "
           f"writers passed through)" if c.get("over_limit_bytes") else ""),
        *([f"  store      {c['store']} on {c['filesystem']}: RAM bounded by the "
            f"{c['ram_bounded_by']}"
            + (f"; huge pages {c['huge_pages']}" if c.get("ram_bounded_by") == "cache size" else "")]
          if c.get("filesystem") else []),
        f"  data path  {data_path(d)}",
        *([f"  uncached   {cr['files']} files read from the backing "
           f"{'file by the kernel' if (d.get('passthrough') or {}).get('on') else 'by the daemon'} "
           f"now ({cr['opens']} opens; {cr['opened']} since mount"
           + (f"; {cr['refused']} refused by the kernel" if cr.get("refused") else "") + ")"]
          if (cr := d.get("cold_reads") or {}).get("opened") else []),
        *([f"  fetched    {format_size(cr['fetched_bytes'])} from the backing into the cache since "
           f"mount ({cr['kept']} files kept after a read"
           + (f", {cr['keeping']} to keep" if cr.get("keeping") else "") + ")"]
          if cr.get("fetched_bytes") else []),
        *peer_plane_lines(d.get("peer_plane") or {}),
        *replica_lines(d.get("replicas") or {}),
        *([f"  backing    asked by lookups and opens on the event loop ({bc['fstype']}, a local "
           f"filesystem): {bc['inline']} calls, {bc['threaded']} in worker threads (the "
           f"flusher held the backing)"] if (bc := d.get("backing_calls") or {}).get("where") == "inline"
          else []),
        f"  dirty      {di['files']} files, {format_size(di['bytes'])}",
        f"  flushing   {fl['files']} files, {format_size(fl['bytes'])} "
        f"({fl['in_flight']} uploads in flight, {d['queue']['pending_ops']} operations queued)",
        f"  persisted  {p['files']} files, {format_size(p['bytes'])} since mount; "
        f"rate {format_size(d['flush_rate_bytes_per_s'])}/s",
    ]
    if d["oldest_dirty_age_s"] is not None:
        lines.append(f"  oldest unsaved change: {age(d['oldest_dirty_age_s'])} ago")
    rec = d.get("recovery")
    if rec:
        lines.append(f"  recovered  {rec['files']} files and {rec['replayed_ops']} operations from a "
                     f"dead daemon ({age(max(0.0, time.time() - rec['started']))} ago)")
        for path in rec["lost_open_files"][:10]:
            lines.append(f"  LOST       {safe(path)}: open for writing at the crash; unsaved changes dropped")
        pending = set(rec.get("aside_pending", ()))
        for path in rec["kept_aside"][:10]:
            where = ("in the backing" if path not in pending else "pending: not in the backing "
                     "yet" + ("; see ERROR below" if d["errors"] else ""))
            lines.append(f"  KEPT ASIDE {safe(path)} ({where}): content the recovery could not "
                         "put in its place")
    if d.get("journal_error"):
        lines.append(f"  ERROR      the crash journal cannot be written ({d['journal_error']}): a "
                     f"daemon crash now would lose what is pending")
    if not d.get("flusher_alive", True):
        lines.append(f"  ERROR      the flusher has stopped: nothing more is persisted; see {d['log_file']}")
    if d["errors"]:
        for e in d["errors"]:
            lines.append(f"  ERROR      {e['op']} {safe(e['path'])}: {e['reason']} "
                         f"({e['attempts']} attempts, next in {e['next_retry_in_s']}s)")
    else:
        lines.append("  errors     none")
    cf = d.get("conflicts")
    if cf and cf["total"]:
        kinds = ", ".join(f"{n} {k}" for k, n in cf["by_kind"].items() if n)
        lines.append(f"  conflicts  {cf['total']} with other writers of the backing ({kinds}); "
                     f"see {d['log_file']}")
        for c in cf["recent"][-3:]:
            lines.append(f"    {c['kind']:<13} {safe(c['path'])}: {safe(c['resolution'])}")
    if d.get("peers") and (d["peers"]["peers"] or d["peers"].get("held") or d["peers"].get("error")):
        lines.extend(render_peers(d["peers"]))
    for f in d.get("files", {}).get("files", []):
        lines.append(f"    {safe(f['state']):<10} {format_size(f['size']):>10}  {safe(f['path'])}")
    if d.get("files", {}).get("truncated"):
        lines.append(f"    ... {d['files']['total']} files in all")
    return "\n".join(lines)


def check_status(mountpoint: str | None, max_unsaved_age: float | None) -> int:
    """``status --check [MOUNTPOINT]``: one line per mount, exit status the worst of them."""
    if mountpoint:
        try:
            mounts = [mounttable.mount_of(mountpoint)]
        except Failure:
            print(f"DOWN {safe(mountpoint)}: not an acpfs mount")
            return health.DOWN
    else:
        mounts = mounttable.acpfs_mounts()
        if not mounts:
            print("DOWN: no acpfs mounts")
            return health.DOWN
    worst = health.HEALTHY
    for m in mounts:
        try:
            doc = {"mountpoint": m, "stale": True} if client.is_stale(m) else client.read_status(m)
        except Failure as e:
            doc, code, why = {}, health.DOWN, [str(e)]
        else:
            code, why = health.health(doc, max_unsaved_age)
        if code == health.HEALTHY:
            print(f"OK {safe(m)}: {doc['dirty']['files']} files unsaved, "
                  f"{doc['queue']['pending_ops']} operations to persist")
        else:
            print(f"{'DEGRADED' if code == health.DEGRADED else 'DOWN'} {safe(m)}: " + "; ".join(why))
        worst = max(worst, code)
    return worst
