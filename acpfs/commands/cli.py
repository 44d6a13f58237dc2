"""The ``acpfs`` command: mount, status, sync, preload, temps, umount.

Every user error ends in one line on stderr (``acpfs: ...``) and a non-zero exit status:
2 for bad usage, 1 when the operation failed or timed out (``Failure``). The commands
talk to a daemon only through the control attributes of its mount, by way of ``client``.
This module imports neither numpy nor pyfuse3 at the top: ``mount`` forks the daemon before
any thread exists.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

from .. import mounttable
from .. import __version__, userdirs
from . import client, syncing, watch
from ..daemon import health
from ..fuse import passthrough
from ..errors import Failure, UsageError
from ..mounttable import FSTYPE
from ..config import age, safe
from ..daemon.health import held_text
from .progress import Progress
from ..config import (CACHE_AREA, DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_FRACTION,
                     DEFAULT_CACHE_FULL_TIMEOUT, DEFAULT_COHERENCE_TIMEOUT, DEFAULT_FLUSH_WORKERS,
                     DEFAULT_FSYNC, DEFAULT_GLOBAL_ORDER, DEFAULT_LOG_LEVEL, DEFAULT_MAX_CLOCK_SKEW,
                     DEFAULT_METRICS, METRICS_HOST,
                     DEFAULT_PASSTHROUGH, DEFAULT_PEER_HEARTBEAT, DEFAULT_PEER_LEASE,
                     DEFAULT_PERSIST_OPEN_AFTER, DEFAULT_TEMPS_OLDER_THAN, DEFAULT_WATCH_INTERVAL,
                     ROOT_LOG_DIR, USER_STATE_DIR, default_cache_dir,
                     default_cache_size, default_log_file, env, env_flag, format_size, key_of,
                     parse_size, short_size)

LOG_LEVELS = ("debug", "info", "warning", "error")
FSYNC_CHOICES = {   # --fsync: what fsync() waits for
    "memory": "returns at once, data is in RAM",
    "backing": "waits until the file is durable in the backing directory",
}
PASSTHROUGH_CHOICES = {   # --passthrough, one per passthrough.MODES
    "auto": "where possible",
    "on": "fail the mount where not",
    "off": "every request goes through the daemon",
}


# -- stale mounts ------------------------------------------------------------------------
def clean_stale(mountpoint: str) -> None:
    print(f"acpfs: {mountpoint}: the daemon of this mount is gone (transport endpoint not connected); "
          f"detaching the stale mount", file=sys.stderr)
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False, capture_output=True)
    if mounttable.mount_type(mountpoint) is not None:
        subprocess.run(["umount", "-l", mountpoint], check=False, capture_output=True)


# -- commands ----------------------------------------------------------------------------
def cmd_mount(a: argparse.Namespace) -> int:
    backing, mountpoint, cache_dir = mount_places(a)
    if a.from_command_line:
        from ..fuse.fastwrite import reexec_for_copies
        reexec_for_copies()
    settings = mount_settings(a)
    lock = open_lock(f"mount-{key_of(mountpoint)}.lock")
    fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent 'acpfs mount' calls: one at a time
    try:
        if mounted_already(mountpoint, backing):
            return 0
        opts = mount_options(a, backing, mountpoint, cache_dir, settings)
        if opts.foreground:
            return run_foreground(opts, lock)
        return start_daemon(opts, lock)
    finally:
        lock.close()


def mount_places(a: argparse.Namespace) -> tuple[str, str, str]:
    """(backing, mount point, cache directory) of ``acpfs mount``, absolute and checked
    (``check_places``); nothing is created yet."""
    for opt in ("backing", "cache_dir", "cache_size", "log_file", "log_level", "block_size", "fsync"):
        if getattr(a, opt, None) is not None and not getattr(a, opt).strip():
            raise UsageError(f"--{opt.replace('_', '-')} is empty")
    if not os.path.isdir(a.backing):
        raise UsageError(f"backing directory {a.backing} does not exist or is not a directory")
    if not os.path.isdir(a.mountpoint) and not client.is_stale(a.mountpoint):
        raise UsageError(f"mount point {a.mountpoint} does not exist or is not a directory")
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):   # libfuse opens it
        raise UsageError("/dev/fuse is closed to users other than root: it needs mode 0666, as "
                         "udev sets it (some containers leave it 0600)")
    backing = os.path.realpath(a.backing)
    mountpoint = os.path.realpath(a.mountpoint)
    cache_dir = os.path.abspath(a.cache_dir or env("cache_dir") or default_cache_dir(backing))
    check_places(backing, mountpoint, cache_dir)
    return backing, mountpoint, cache_dir


def text_setting(a: argparse.Namespace, name: str, default: str) -> str:
    """An option as typed: on the command line, else in its ACPFS_* variable, else
    ``default`` (an empty value counts as none)."""
    return getattr(a, name) or env(name) or default


def seconds_setting(a: argparse.Namespace, name: str, default: float) -> float:
    """A number of seconds: on the command line, else in its ACPFS_* variable, else
    ``default``."""
    value = getattr(a, name)
    return value if value is not None else float_env(name, default)


def mount_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``daemon.Options`` that need nothing on disk, from the command line,
    the environment and config's defaults; checked in the order of the options' help."""
    fsync = text_setting(a, "fsync", DEFAULT_FSYNC)
    if fsync not in FSYNC_CHOICES:
        raise UsageError(f"invalid --fsync {fsync!r}: use 'memory' or 'backing'")
    workers = a.flush_workers if a.flush_workers is not None \
        else int_env("flush_workers", DEFAULT_FLUSH_WORKERS)
    if not 1 <= workers <= 64:
        raise UsageError("--flush-workers must be between 1 and 64")
    level = text_setting(a, "log_level", DEFAULT_LOG_LEVEL).lower()
    if level not in LOG_LEVELS:
        raise UsageError(f"invalid --log-level {level!r}: use {spoken(LOG_LEVELS)}")
    settings = dict(fsync_backing=fsync == "backing", flush_workers=workers, log_level=level,
                    **timeout_settings(a))
    order = text_setting(a, "global_order", DEFAULT_GLOBAL_ORDER)
    if order not in ("on", "off"):
        raise UsageError(f"invalid --global-order {order!r}: use 'on' or 'off'")
    settings.update(global_order=order == "on", **peer_settings(a))
    block_size_text = a.block_size or env("block_size")
    block_size = parse_size(block_size_text, "block size") if block_size_text else DEFAULT_BLOCK_SIZE
    if block_size < 4096 or block_size & (block_size - 1) or block_size > (16 << 20):
        raise UsageError("--block-size must be a power of two between 4K and 16M")
    foreground = a.foreground or env_flag("foreground")
    pt_mode = text_setting(a, "passthrough", DEFAULT_PASSTHROUGH).lower()
    if pt_mode not in passthrough.MODES:
        raise UsageError(f"invalid --passthrough {pt_mode!r}: use auto, on or off")
    settings.update(block_size=block_size, foreground=foreground, passthrough=pt_mode)
    metrics = text_setting(a, "metrics", DEFAULT_METRICS).strip()
    if metrics:
        from ..daemon.metrics_http import parse_address
        parse_address(metrics)
    settings.update(metrics=metrics)
    return settings


def timeout_settings(a: argparse.Namespace) -> dict[str, float]:
    """--cache-full-timeout, --persist-open-after and --coherence-timeout."""
    full_timeout = seconds_setting(a, "cache_full_timeout", DEFAULT_CACHE_FULL_TIMEOUT)
    persist_open = seconds_setting(a, "persist_open_after", DEFAULT_PERSIST_OPEN_AFTER)
    coherence = seconds_setting(a, "coherence_timeout", DEFAULT_COHERENCE_TIMEOUT)
    if persist_open < 0 or full_timeout < 0 or coherence < 0:
        raise UsageError("--cache-full-timeout, --persist-open-after and --coherence-timeout must "
                         "not be negative")
    return dict(cache_full_timeout=full_timeout, persist_open_after=persist_open,
                coherence_timeout=coherence)


def peer_settings(a: argparse.Namespace) -> dict[str, float]:
    """--max-clock-skew, --peer-heartbeat and --peer-lease (global order: peers.py)."""
    skew = seconds_setting(a, "max_clock_skew", DEFAULT_MAX_CLOCK_SKEW)
    beat = seconds_setting(a, "peer_heartbeat", DEFAULT_PEER_HEARTBEAT)
    lease = seconds_setting(a, "peer_lease", DEFAULT_PEER_LEASE)
    if not 0 <= skew <= 1:
        raise UsageError("--max-clock-skew must be between 0 and 1 second")
    if not 0.05 <= beat <= 60:
        raise UsageError("--peer-heartbeat must be between 0.05 and 60 seconds")
    if not lease >= 3 * beat:
        raise UsageError("--peer-lease must be at least 3 heartbeats (--peer-heartbeat)")
    return dict(max_clock_skew=skew, peer_heartbeat=beat, peer_lease=lease)


def mounted_already(mountpoint: str, backing: str) -> bool:
    """True when ``mountpoint`` is already this very mount (nothing to do). A stale acpfs
    mount there is detached; another mount, or a mount point holding files, is refused.
    Called holding the mount point's lock."""
    kind = mounttable.mount_type(mountpoint)
    if kind == FSTYPE:
        if client.is_stale(mountpoint):
            clean_stale(mountpoint)
        else:
            st = client.read_status(mountpoint)
            if st["backing"] == backing:
                print(f"acpfs: {mountpoint} is already mounted over {backing} (pid {st['pid']})",
                      file=sys.stderr)
                return True
            raise UsageError(f"{mountpoint} is already an acpfs mount of {st['backing']}")
    elif kind is not None:
        raise UsageError(f"{mountpoint} is already a mount point ({kind})")
    if os.listdir(mountpoint):
        raise UsageError(f"mount point {mountpoint} is not empty")
    return False


def mount_options(a: argparse.Namespace, backing: str, mountpoint: str, cache_dir: str,
                  settings: dict[str, Any]):
    """The daemon's ``Options``, once the backing is free and the cache directory made and
    big enough (``settings``: from ``mount_settings``). Called holding the mount point's
    lock."""
    from ..daemon.daemon import Options
    check_backing_free(backing)
    cache_size_text = a.cache_size or env("cache_size")
    asked = parse_size(cache_size_text, "cache size") if cache_size_text else None
    userdirs.secure_dir(cache_dir, "cache directory")   # not made for a bad --cache-size
    cache_size = asked if asked is not None else default_cache_size(os.path.dirname(cache_dir))
    check_cache_fits(cache_size, os.path.dirname(cache_dir), cache_dir)
    if settings["passthrough"] == "on":
        from ..fuse import fastwrite
        why_not = passthrough.plan("on", cache_dir, fastwrite.extension())[1]
        if why_not:
            raise UsageError(f"--passthrough on: kernel passthrough is not possible here: "
                             f"{why_not} (--passthrough auto mounts without it)")
    block_size = settings["block_size"]
    if cache_size < block_size * 16:
        raise UsageError(f"cache size {cache_size_text} is too small: at least "
                         f"{format_size(block_size * 16)}")
    log_file = a.log_file or env("log_file") or default_log_file(mountpoint)
    return Options(mountpoint=mountpoint, backing=backing, cache_dir=cache_dir,
                   cache_size=cache_size, log_file=log_file,
                   allow_other=a.allow_other or env_flag("allow_other"),
                   noexec=a.noexec or env_flag("noexec"),
                   mlock=a.mlock or env_flag("mlock"), **settings)


def inside(path: str, top: str) -> bool:
    """``path`` is ``top`` or below it (both absolute, real)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def check_places(backing: str, mountpoint: str, cache_dir: str) -> None:
    """Refuse a mount whose directories hold one another, before anything is created: the
    backing, the mount point and the cache directory each apart from the others, the backing
    neither inside nor around acpfs's cache areas in /dev/shm (other mounts' pools and
    journals live there: the mount would serve them, or be taken for one), and neither the
    backing nor the cache directory on an acpfs mount (the daemon would wait on itself)."""
    cache = os.path.realpath(cache_dir)
    places = (("backing directory", backing), ("mount point", mountpoint), ("cache directory", cache))
    for what, path in places:
        for other, top in places:
            if what != other and inside(path, top):
                raise UsageError(f"{what} {path} is "
                                 f"{'the same directory as' if path == top else 'inside'} the "
                                 f"{other} {top}")
    mine = os.path.dirname(default_cache_dir(backing))   # /dev/shm/acpfs-UID
    shm = os.path.realpath(os.path.dirname(mine))
    areas = {os.path.join(shm, os.path.basename(mine))}
    try:   # and other users'
        areas.update(os.path.join(shm, n) for n in os.listdir(shm)
                     if n.startswith("acpfs-") and n[6:].isdigit())
    except OSError:
        pass
    for area in sorted(areas):
        if inside(backing, area) or inside(area, backing):
            raise UsageError(f"backing directory {backing} "
                             f"{'is inside' if inside(backing, area) else 'holds'} {area}, "
                             f"where acpfs keeps the cache directories of mounts (their pools "
                             f"and journals): use a directory elsewhere")
    for m in mounttable.acpfs_mounts():
        for what, path in (("backing directory", backing), ("cache directory", cache)):
            if inside(path, m):
                raise UsageError(f"{what} {path} is on the acpfs mount {m}")


def check_cache_fits(size: int, where: str, cache_dir: str) -> None:
    from ..config import total_ram
    ram = total_ram()
    if size > ram * 0.9:
        raise UsageError(f"cache size {format_size(size)} is more than 90% of RAM ({format_size(ram)})")
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    try:   # a pool left by a previous daemon is reused (and holds what it left to recover)
        free += os.stat(os.path.join(cache_dir, "pool")).st_blocks * 512
    except OSError:
        pass
    if size > free:
        raise UsageError(f"cache size {format_size(size)} does not fit in {where} "
                         f"({format_size(free)} free)")


def int_env(name: str, default: int) -> int:
    v = env(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"invalid ACPFS_{name.upper()}={v!r}: not an integer") from None


def float_env(name: str, default: float) -> float:
    v = env(name)
    if v is None:
        return default
    try:
        return seconds(v)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"invalid ACPFS_{name.upper()}={v!r}: {e}") from None


def seconds(text: str) -> float:
    """A number of seconds (argparse type): finite, or the option is refused."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a finite number of seconds: {text!r}")
    return v


def open_lock(name: str):
    return os.fdopen(userdirs.open_private(name), "a+")


def check_backing_free(backing: str) -> None:
    with open_lock(f"backing-{key_of(backing)}.lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            where = f.read().strip()
            raise UsageError(f"backing directory {backing} is already mounted"
                             + (f" at {where}" if where else "")) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def run_foreground(opts, lock) -> int:
    from ..daemon import daemon
    lock.close()

    def notify(msg: str) -> None:
        if msg.startswith("progress "):
            print(f"acpfs: {msg[9:]}", file=sys.stderr)
    try:
        return daemon.run(opts, notify)
    except (RuntimeError, OSError, ValueError) as e:
        raise Failure(f"cannot mount {opts.mountpoint}: {e}") from None


def start_daemon(opts, lock) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        code = 1
        try:
            os.close(r)
            lock.close()
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)

            def notify(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass
            from ..daemon import daemon
            try:
                code = daemon.run(opts, notify)
            except BaseException as e:
                import logging
                logging.getLogger("acpfs").exception("mount failed")
                notify(f"error {e}")
        finally:
            os._exit(code)
    os.close(w)
    prog = Progress()
    buf = b""
    warnings = []   # said once the mount is live: a refusal stays one line
    with os.fdopen(r, "rb") as pipe:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            if line == "ready":
                prog.done(f"acpfs: mounted {opts.mountpoint} over {opts.backing} "
                          f"(cache {format_size(opts.cache_size)}, log {opts.log_file})")
                for w in warnings:
                    print(f"acpfs: warning: {safe(w)}", file=sys.stderr)
                return 0
            if line.startswith("progress "):
                prog.update(line[9:])
            elif line.startswith("warning "):
                warnings.append(line[8:])
            elif line.startswith("error "):
                buf = line[6:].encode()
    prog.done()
    os.waitpid(pid, 0)
    raise Failure(f"cannot mount {opts.mountpoint}: {buf.decode() or 'the daemon exited'} "
                  f"(log: {opts.log_file})")


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
        return health.check_status(a.mountpoint, a.max_unsaved_age)
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
             f"(skew {pe['skew']:g}s, lease {pe['lease']:g}s)"]
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
        return f"kernel passthrough into {store} ({pt.get('opens', 0)} opens passed through)"
    return f"through the daemon, {store} ({pt.get('why_not') or 'passthrough not asked for'})"


def render_status(d: dict[str, Any]) -> str:
    if d.get("stale"):
        return f"{d['mountpoint']}  STALE: the daemon is gone; run 'acpfs umount {d['mountpoint']}'"
    c, di, fl, p = d["cache"], d["dirty"], d["flushing"], d["persisted_since_mount"]
    lines = [
        f"{d['mountpoint']}  (backing {d['backing']}, pid {d['pid']}, up {age(d['uptime_s'])})",
        f"  cache      {format_size(c['used_bytes'])} used of {format_size(c['limit_bytes'])} "
        f"(peak {format_size(c['peak_used_bytes'])}), {c['cached_files']} files cached",
        f"  data path  {data_path(d)}",
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


def cmd_sync(a: argparse.Namespace) -> int:
    if a.all_nodes:
        return sync_all_nodes(a)
    if a.path:
        mount = client.live_mount(a.path)
        try:
            seq, open_dirty = client.read_seq(a.path)
        except client.StaleMount:
            raise client.gone(a.path, mount) from None
        except Failure as e:
            raise Failure(f"cannot sync {a.path}: {e.strerror}") from None
        if open_dirty:
            print(f"acpfs: sync: {open_dirty} files under {safe(a.path)} are still open for writing; "
                  f"their data is persisted after they are closed", file=sys.stderr)
        syncing.wait_durable(mount, seq, a.timeout, f"sync {safe(a.path)}")
        return 0
    targets = []
    stale = []
    for mount in mounttable.acpfs_mounts():
        if client.is_stale(mount):
            stale.append(mount)
            print(f"acpfs: sync: skipping {mount}: its daemon is gone (stale mount)", file=sys.stderr)
            continue
        targets.append((mount, client.read_status(mount)["queue"]["last_seq"]))
    for mount, seq in targets:
        syncing.wait_durable(mount, seq, a.timeout, f"sync {mount}")
    return 1 if stale else 0


def sync_all_nodes(a: argparse.Namespace) -> int:
    """``sync --all-nodes [PATH]``: the mount holding PATH, or every live acpfs mount."""
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    if a.path:
        mounts = [client.live_mount(a.path)]
    else:
        mounts = [m for m in mounttable.acpfs_mounts() if not client.is_stale(m)]
        if not mounts:
            raise Failure("sync --all-nodes: no live acpfs mount on this node")
    for mount in mounts:
        start = time.monotonic()
        try:
            others = syncing.all_nodes(mount, deadline)
        except client.StaleMount:
            raise client.gone(a.path or mount, mount) from None
        print(f"acpfs: sync --all-nodes {mount}: this node and {others} other nodes have "
              f"persisted what they acknowledged before the call "
              f"({time.monotonic() - start:.1f}s)", file=sys.stderr)
    return 0


def cmd_preload(a: argparse.Namespace) -> int:
    n, nbytes, left_out = client.preload(a.paths)
    for line in left_out[:20]:
        print(f"acpfs: preload: not loaded: {safe(line)}", file=sys.stderr)
    if len(left_out) > 20:
        print(f"acpfs: preload: ... and {len(left_out) - 20} more not loaded", file=sys.stderr)
    print(f"acpfs: preloaded {n} files ({format_size(nbytes)})"
          + (f"; {len(left_out)} did not fit in the cache" if left_out else ""), file=sys.stderr)
    return 1 if left_out else 0


def cmd_umount(a: argparse.Namespace) -> int:
    stale = client.is_stale(a.mountpoint)
    mountpoint = os.path.abspath(a.mountpoint) if stale else os.path.realpath(a.mountpoint)
    kind = mounttable.mount_type(mountpoint)
    if kind != FSTYPE:
        raise UsageError(f"{a.mountpoint} is not an acpfs mount")
    if client.is_stale(mountpoint):
        clean_stale(mountpoint)
        return 0
    st = client.read_status(mountpoint)
    pid = st["pid"]
    dev = next((m.dev for m in mounttable.table() if m.mountpoint == mountpoint and m.fstype == FSTYPE), "")
    syncing.wait_durable(mountpoint, st["queue"]["last_seq"], a.timeout, f"umount {mountpoint}: persisting")
    cmd = ["fusermount3", "-u"] + (["-z"] if a.lazy else []) + [mountpoint]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
        raise Failure(f"cannot unmount {mountpoint}: {msg} (files still open? 'acpfs umount --lazy' "
                      f"detaches now and persists after they are closed)")
    prog = Progress()
    start = time.monotonic()
    told = False
    while pid_alive(pid):
        waited = time.monotonic() - start
        if waited > 0.5 and not told and dev:
            told = True
            holders = mounttable.holders_elsewhere(dev)
            if holders:
                prog.done()
                print(f"acpfs: {mountpoint} is unmounted here, but still mounted in "
                      + "; ".join(f"the mount namespace of pid {p} ({safe(c)}) at {safe(w)}"
                                  for p, c, w in holders)
                      + ": its daemon serves that until it is unmounted there", file=sys.stderr)
        prog.update(f"umount {mountpoint}: waiting for the daemon (pid {pid}) to persist the rest "
                    f"({age(waited)})")
        if a.timeout is not None and time.monotonic() - start > a.timeout:
            prog.done()
            raise Failure(f"unmounted {mountpoint}, but its daemon (pid {pid}) is still persisting "
                          f"after {a.timeout:g}s; see {st['log_file']}")
        time.sleep(0.05)
    prog.done()
    print(f"acpfs: unmounted {mountpoint}; everything is persisted in {st['backing']}", file=sys.stderr)
    return 0


def cmd_temps(a: argparse.Namespace) -> int:
    from . import leftovers
    backing = os.path.realpath(a.backing)
    try:   # a mount hides the temporary files: its backing is the place to look
        mount = mounttable.mount_of(backing)
    except Failure:
        pass
    else:
        if client.is_stale(mount):
            raise client.gone(a.backing, mount)
        raise UsageError(f"{a.backing} is on the acpfs mount {mount}, which hides temporary "
                         f"files: give its backing directory, "
                         f"{client.read_status(mount)['backing']}")
    if not os.path.isdir(backing):
        raise UsageError(f"{a.backing} is not a directory")
    try:
        older = leftovers.parse_age(a.older_than)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.remove and not a.yes and not sys.stdin.isatty():
        raise UsageError("--remove asks for confirmation: run it on a terminal, or add --yes")
    live = {}   # instance -> mount point, of the daemons on this host over this backing
    for mp in mounttable.acpfs_mounts():
        try:
            st = client.read_status(mp)
        except (Failure, OSError, ValueError):
            continue
        if st.get("instance") and os.path.realpath(st["backing"]) == backing:
            live[st["instance"]] = mp
    waiting = leftovers.awaiting_recovery(backing)   # a dead daemon's journal names them
    found = leftovers.scan(backing)
    old = [t for t in found if t.age_s >= older and t.instance not in live and t.instance not in waiting]
    for t in found:
        note = (f"  (live: {safe(live[t.instance])})" if t.instance in live
                else f"  (awaiting recovery from {safe(waiting[t.instance])})" if t.instance in waiting
                else "" if t.age_s >= older else "  (too recent)")
        print(f"{age(t.age_s):>8} {format_size(t.size):>10}  {t.instance or '-':12}  "
              f"{safe(t.path)}{'/' if t.is_dir else ''}{note}")
    total = sum(t.size for t in old)
    print(f"acpfs: {len(found)} temporary files in {backing}; {len(old)} older than {a.older_than} "
          f"and of no daemon on this host, live or awaiting recovery ({format_size(total)})",
          file=sys.stderr)
    if not a.remove or not old:
        return 0
    if not a.yes:
        answer = input(f"remove {len(old)} temporary files ({format_size(total)})? A daemon of "
                       f"another node that is still alive loses its upload in flight. [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("acpfs: nothing removed", file=sys.stderr)
            return 1
    for t in old:
        leftovers.remove(backing, t)
    print(f"acpfs: removed {len(old)} temporary files ({format_size(total)})", file=sys.stderr)
    return 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own child in tests) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- argument parsing ----------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def spoken(words) -> str:
    """'a, b, c or d'."""
    words = list(words)
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="acpfs", description="RAM-backed write-back FUSE cache for checkpoints: writes "
               "return at memory speed, a flusher persists closed files to the backing directory "
               "atomically and in order.")
    p.add_argument("--version", action="version", version=f"acpfs {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)
    add_mount_command(sub)
    add_status_command(sub)
    add_sync_command(sub)
    add_preload_command(sub)
    add_temps_command(sub)
    add_umount_command(sub)
    return p


def add_mount_command(sub) -> None:
    m = sub.add_parser("mount", help="mount a write-back cache over a backing directory",
                       description="Mount MOUNTPOINT as a RAM-backed write-back cache over BACKING. "
                       "Returns once the mount is live (the daemon keeps running); calling it again "
                       "for the same mount and backing is a no-op. Each option has an ACPFS_* "
                       "environment variable (e.g. ACPFS_CACHE_SIZE).")
    add_mount_arguments(m)
    m.set_defaults(fn=cmd_mount)


def add_mount_arguments(m: argparse.ArgumentParser) -> None:
    """The arguments of ``acpfs mount``; the mount helper (mounthelper.py) reads its ``-o``
    options from them too."""
    m.add_argument("mountpoint", help="empty directory to mount on")
    add_cache_options(m)
    add_global_order_options(m)
    add_daemon_options(m)


def add_cache_options(m: argparse.ArgumentParser) -> None:
    """The options of ``acpfs mount`` about the backing, the cache and when data is persisted."""
    m.add_argument("--backing", required=True, help="directory where files are persisted (e.g. on NFS); "
                   f"apart from the mount point and the cache directory, not in {CACHE_AREA}/acpfs-UID")
    m.add_argument("--cache-dir", help="private directory for the cache pool "
                   f"(default {CACHE_AREA}/acpfs-UID/<hash of the backing path>)")
    m.add_argument("--cache-size", help="RAM for cached data: bytes with K/M/G/T suffix or N%% of RAM "
                   f"(default {DEFAULT_CACHE_FRACTION * 100:g}%% of RAM, at most half the free space "
                   "of the cache directory)")
    m.add_argument("--fsync", choices=tuple(FSYNC_CHOICES),
                   help="what fsync() waits for: " + " or ".join(
                       f"'{c}' ({'default: ' if c == DEFAULT_FSYNC else ''}{what})"
                       for c, what in FSYNC_CHOICES.items()))
    m.add_argument("--flush-workers", type=int,
                   help=f"parallel uploads to the backing (default {DEFAULT_FLUSH_WORKERS})")
    m.add_argument("--cache-full-timeout", type=seconds,
                   help="seconds a writer waits for free cache before getting ENOSPC "
                   f"(default {DEFAULT_CACHE_FULL_TIMEOUT:g})")
    m.add_argument("--persist-open-after", type=seconds, metavar="S",
                   help="persist the content of a file still open for writing after S seconds of "
                   "unsaved changes: published if it is only appended to (O_APPEND), else staged "
                   f"in the backing without replacing the file (default {DEFAULT_PERSIST_OPEN_AFTER:g}; "
                   "0: never)")
    m.add_argument("--coherence-timeout", type=seconds, metavar="S",
                   help="how long this node trusts what it knows of a directory before it looks "
                   "at the backing again for entries other nodes made or removed "
                   f"(default {DEFAULT_COHERENCE_TIMEOUT:g}; 0: at every lookup of a missing name "
                   "and every listing)")


def add_global_order_options(m: argparse.ArgumentParser) -> None:
    """The options of ``acpfs mount`` for several nodes over one backing (peers.py)."""
    m.add_argument("--global-order", choices=("on", "off"),
                   help="with several nodes over one backing, apply a change to the backing only "
                   "after every other live node has persisted what it acknowledged before it "
                   f"(default {DEFAULT_GLOBAL_ORDER}; a node alone pays nothing; docs/semantics.md)")
    m.add_argument("--max-clock-skew", type=seconds, metavar="S",
                   help="how far apart the nodes' clocks may be for global order to hold; each "
                   "change acknowledged while other nodes are live waits this long "
                   f"(default {DEFAULT_MAX_CLOCK_SKEW:g})")
    m.add_argument("--peer-heartbeat", type=seconds, metavar="S",
                   help="how often an idle node renews its record in the backing "
                   f"(default {DEFAULT_PEER_HEARTBEAT:g})")
    m.add_argument("--peer-lease", type=seconds, metavar="S",
                   help="a node that has not renewed its record for S seconds (dead, hung, cut "
                   f"off from the backing) holds nobody back any more (default {DEFAULT_PEER_LEASE:g})")


def add_daemon_options(m: argparse.ArgumentParser) -> None:
    """The options of ``acpfs mount`` about the daemon: its data path, memory, log, access."""
    m.add_argument("--passthrough", choices=passthrough.MODES,
                   help="kernel passthrough: the kernel reads, writes and maps cached files "
                   "itself, at memory speed (Linux 6.9+, root). " + "; ".join(
                       f"'{mode}'{' (default)' if mode == DEFAULT_PASSTHROUGH else ''}: "
                       f"{PASSTHROUGH_CHOICES[mode]}" for mode in passthrough.MODES))
    m.add_argument("--block-size", help="cache block size, a power of two "
                   f"(default {short_size(DEFAULT_BLOCK_SIZE)}; the daemon's path only)")
    m.add_argument("--mlock", action="store_true", help="lock the cache pool in RAM")
    m.add_argument("--log-level", help=spoken(
        f"{level} (default)" if level == DEFAULT_LOG_LEVEL else level for level in LOG_LEVELS))
    m.add_argument("--log-file", help=f"daemon log ('-' for stderr; default {ROOT_LOG_DIR}/<mount>.log "
                   f"for root, {USER_STATE_DIR}/acpfs/<mount>.log otherwise)")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    m.add_argument("--noexec", action="store_true",
                   help="mount with noexec: the kernel runs no program from the mount")
    m.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT or :PORT: on "
                   f"{METRICS_HOST}; another address only when named; default: off)")
    m.add_argument("--foreground", "-f", action="store_true",
                   help="do not daemonize; log to stderr too (for systemd and debugging)")


def add_status_command(sub) -> None:
    s = sub.add_parser("status", help="show what is cached, dirty, flushing, failed",
                       description="Show the state of one acpfs mount, or of every acpfs mount.")
    s.add_argument("mountpoint", nargs="?", help="a mount (or a path in it); default: all mounts")
    s.add_argument("--json", action="store_true", help="machine-readable (schema: docs/status.md)")
    s.add_argument("--files", action="store_true", help="also list files not yet persisted")
    s.add_argument("--prometheus", action="store_true",
                   help="print Prometheus metrics, as the --metrics endpoint serves them, for "
                   "node_exporter's textfile collector (docs/operations.md)")
    s.add_argument("--check", action="store_true",
                   help="health check: one line per mount; exit status 0 healthy, 1 degraded "
                   "(failing operations, a dead flusher, a journal error, a node holding changes "
                   "back, unsaved data too old), 2 not mounted or stale")
    s.add_argument("--max-unsaved-age", type=seconds, metavar="S",
                   help="with --check: unsaved data older than S seconds is degraded")
    s.add_argument("--watch", action="store_true",
                   help="a line per interval with what the mount did in it: bytes queued and "
                   "persisted per second, files persisted per second, the queue, unsaved "
                   "data, errors; until interrupted")
    s.add_argument("--interval", type=seconds, metavar="S",
                   help=f"with --watch: seconds between lines (default {DEFAULT_WATCH_INTERVAL:g})")
    s.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N lines")
    s.set_defaults(fn=cmd_status)


def add_sync_command(sub) -> None:
    y = sub.add_parser("sync", help="wait until changes are durable in the backing directory",
                       description="Block until PATH (default: every change made before the call, "
                       "on every acpfs mount) is durable in the backing directory.")
    y.add_argument("path", nargs="?", help="file or directory on an acpfs mount (with "
                   "--all-nodes: names the mount)")
    y.add_argument("--all-nodes", action="store_true",
                   help="wait until every live node over the backing (this one included) has "
                   "persisted every change it acknowledged before the call (needs global order)")
    y.add_argument("--timeout", type=seconds, help="give up after this many seconds (exit status 1)")
    y.set_defaults(fn=cmd_sync)


def add_preload_command(sub) -> None:
    r = sub.add_parser("preload", help="read files into the cache ahead of a resume",
                       description="Read the files named (directories recursively) from the backing "
                       "directory into the cache, so that loading them later runs at memory speed. "
                       "Stops short of the cache size: files that do not fit are listed and the exit "
                       "status is 1.")
    r.add_argument("paths", nargs="+", metavar="PATH", help="files or directories on an acpfs mount")
    r.set_defaults(fn=cmd_preload)


def add_temps_command(sub) -> None:
    t = sub.add_parser("temps", help="list, and remove, temporary files that dead daemons left in a backing",
                       description="List the acpfs temporary files under a backing directory "
                       "(.acpfs-tmp-<instance>-*: uploads, staging directories) with their age, "
                       "size and daemon instance, and with --remove remove those older than "
                       "--older-than that belong to no daemon on this host. A daemon only removes "
                       "its own; those of a daemon whose cache directory is gone stay until "
                       "removed here. Daemons of other nodes cannot be seen from here: the age "
                       "is the guard.")
    t.add_argument("backing", help="the backing directory (shared by every node)")
    t.add_argument("--older-than", default=DEFAULT_TEMPS_OLDER_THAN, metavar="AGE",
                   help="only temporaries unchanged for this long: 90s, 30m, 6h, 2d "
                   f"(default {DEFAULT_TEMPS_OLDER_THAN})")
    t.add_argument("--remove", action="store_true", help="remove them (asks first)")
    t.add_argument("--yes", "-y", action="store_true", help="do not ask")
    t.set_defaults(fn=cmd_temps)


def add_umount_command(sub) -> None:
    u = sub.add_parser("umount", help="persist everything, unmount, wait for the daemon",
                       description="Persist every change, unmount, and wait until the daemon has "
                       "exited. Also cleans up a stale mount whose daemon died.")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=seconds, help="give up waiting after this many seconds (exit status 1)")
    u.add_argument("--lazy", "-z", action="store_true",
                   help="detach even if files are open; they are persisted after their last close")
    u.set_defaults(fn=cmd_umount)


def main(argv: list[str] | None = None, from_command_line: bool | None = None) -> int:
    """Run one command; ``from_command_line`` (default: whether ``argv`` is None) says
    whether this process was started for it, and so may run itself again (``cmd_mount``)."""
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        a.from_command_line = argv is None if from_command_line is None else from_command_line
        if not getattr(a, "fn", None):
            parser.print_help(sys.stderr)
            return 2
        if getattr(a, "timeout", None) is not None and a.timeout < 0:
            raise UsageError("--timeout must not be negative")
        return a.fn(a)
    except UsageError as e:
        print(f"acpfs: {safe(str(e))}", file=sys.stderr)
        return 2
    except Failure as e:
        print(f"acpfs: {safe(str(e))}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. 'acpfs status | head'
        return 141
    except KeyboardInterrupt:
        print("acpfs: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        name = f"{e.filename}: " if e.filename else ""
        print(f"acpfs: {safe(str(name))}{safe(str(e.strerror or e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
