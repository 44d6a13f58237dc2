"""The ``acpfs`` command: mount, status, sync, preload, temps, umount, recover.

Every user error ends in one line on stderr (``acpfs: ...``) and a non-zero exit status:
2 for bad usage, 1 when the operation failed or timed out (``Failure``). The commands
talk to a daemon only through the control attributes of its mount, by way of ``client``.
This module imports neither numpy nor pyfuse3 at the top: ``mount`` forks the daemon before
any thread exists.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..config import (BACKING_CALLS, CACHE_AREA, DEFAULT_BACKING_CALLS, DEFAULT_BLOCK_SIZE,
                      DEFAULT_CACHE_FRACTION, DEFAULT_CACHE_FULL_TIMEOUT,
                      DEFAULT_COHERENCE_TIMEOUT, DEFAULT_FLUSH_WORKERS, DEFAULT_FSYNC,
                      DEFAULT_GLOBAL_ORDER, DEFAULT_IDLE_POLL, DEFAULT_LOG_LEVEL,
                      DEFAULT_MAX_CLOCK_SKEW, DEFAULT_PASSTHROUGH, DEFAULT_PEER_HEARTBEAT,
                      DEFAULT_PEER_LEASE, DEFAULT_PERSIST_OPEN_AFTER, DEFAULT_TEMPS_OLDER_THAN,
                      DEFAULT_WATCH_INTERVAL, FSYNC_CHOICES, IDLE_POLL, LOG_LEVELS, METRICS_HOST,
                      PASSTHROUGH_CHOICES, PASSTHROUGH_MODES, ROOT_LOG_DIR, USER_STATE_DIR, safe,
                      seconds, short_size, spoken)
from ..errors import Failure, UsageError
from .mount import cmd_mount
from .recover import add_recover_command
from .small import cmd_preload, cmd_sync, cmd_temps, cmd_umount
from .status import cmd_status


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


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
    add_recover_command(sub, add_global_order_options)
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
    m.add_argument("--passthrough", choices=PASSTHROUGH_MODES,
                   help="kernel passthrough: the kernel reads, writes and maps cached files "
                   "itself, at memory speed (Linux 6.9+, root). " + "; ".join(
                       f"'{mode}'{' (default)' if mode == DEFAULT_PASSTHROUGH else ''}: "
                       f"{PASSTHROUGH_CHOICES[mode]}" for mode in PASSTHROUGH_MODES))
    m.add_argument("--backing-calls", choices=tuple(BACKING_CALLS),
                   help="where the backing is asked at a lookup or an open: " + "; ".join(
                       f"'{mode}'{' (default)' if mode == DEFAULT_BACKING_CALLS else ''}: "
                       f"{why}" for mode, why in BACKING_CALLS.items()))
    m.add_argument("--idle-poll", choices=tuple(IDLE_POLL),
                   help="whether idle CPUs poll while programs send requests: " + "; ".join(
                       f"'{mode}'{' (default)' if mode == DEFAULT_IDLE_POLL else ''}: "
                       f"{why}" for mode, why in IDLE_POLL.items()))
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
    m.add_argument("--peers-listen", metavar="HOST:PORT",
                   help="serve this node's cached files to the other nodes of the backing at "
                   "HOST:PORT, and read files from theirs before the backing (docs/operations.md, "
                   "\"Nodes serve each other\"; port 0: any free port; default: off)")
    m.add_argument("--replicas", metavar="N",
                   help="1: copy each change not yet persisted to another node's RAM over the "
                   "peer plane (which it needs), and that node persists it if this one is lost "
                   "(docs/semantics.md, \"What survives what\"); default 0")
    m.add_argument("--replica-wait", action="store_true", default=None,
                   help="with replicas on: close() returns once another node holds a copy of "
                   "what it acknowledged (while a node that can hold it is live)")
    m.add_argument("--replica-budget", metavar="SIZE",
                   help="RAM this node gives to other nodes' replicas, apart from the cache "
                   "(default: a quarter of the cache size; with the peer plane)")
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
    y.add_argument("--replicated", action="store_true",
                   help="wait until another node's RAM holds a copy of every change this node "
                   "acknowledged before the call (--replicas 1), not until it is in the backing")
    y.add_argument("--timeout", type=seconds, help="give up after this many seconds (exit status 1)")
    y.set_defaults(fn=cmd_sync)


def add_preload_command(sub) -> None:
    r = sub.add_parser("preload", help="read files into the cache ahead of a resume",
                       description="Read the files named (directories recursively) from the backing "
                       "directory into the cache, so that loading them later runs at memory speed: "
                       "several files at once, each in parallel ranges, with progress in bytes/s. "
                       "Stops short of the cache size: files that do not fit are listed and the exit "
                       "status is 1. With --max-bytes, stops before the first file past that budget "
                       "(the files not read are counted; exit status 0).")
    r.add_argument("paths", nargs="+", metavar="PATH", help="files or directories on an acpfs mount")
    r.add_argument("--max-bytes", metavar="SIZE", help="read at most this much, in the order given "
                   "(bytes with a K/M/G/T suffix)")
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
