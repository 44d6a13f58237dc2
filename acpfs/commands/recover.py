"""``acpfs recover``: persist what a dead daemon left in a cache directory, without mounting.

A daemon killed with SIGKILL (or a node that went down with its cache directory on a disk
that survives) leaves its journal and the content it names in its cache directory. The next
``acpfs mount`` of the same backing with that cache directory finishes the work; this
command does the same without a mount: for a node that will not mount that backing again,
a cache directory copied off a machine, or a backing mounted meanwhile with another cache
directory. The journal is replayed and drained by a daemon that serves no mount
(``daemon.offline.recover_offline``): in the dead daemon's order, with global order kept (its record
takes over the dead daemon's, as a restart does), progress on stderr, and the cache directory
removed once everything is in the backing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import config
from ..config import Options, default_cache_dir, default_log_file, env, key_of, safe
from ..errors import Failure, UsageError
from .mount import inside
from .progress import Progress


def cmd_recover(a: argparse.Namespace) -> int:
    # here, not at the top: every other command starts without the peer plane's imports
    from ..cluster.replicas import locked
    from ..oplog import journal
    backing, cache_dir = places(a)
    a.passthrough = "off"        # nothing is passed through: there is no mount
    for name in ("metrics", "idle_poll", "backing_calls", "block_size", "cache_full_timeout",
                 "persist_open_after", "coherence_timeout", "fsync", "replica_budget"):
        setattr(a, name, None)
    # no plane, no replicas, whatever the environment says: a recovery serves nothing
    a.peers_listen, a.replicas, a.replica_wait, a.foreground = " ", "0", False, False
    a.metrics = " "   # nor metrics (" ": none, whatever ACPFS_METRICS says)
    settings = config.settings(a)   # bad values refused before anything is looked at
    if locked(os.path.join(cache_dir, "lock")):
        raise Failure(f"cache directory {cache_dir} is in use by a live acpfs daemon: its journal "
                      f"is that daemon's to persist (acpfs umount persists it)")
    left = journal.read_leftover(cache_dir) if os.path.isdir(cache_dir) else None
    if left is None:
        print(f"acpfs: nothing to recover in {safe(cache_dir)} (no journal of a dead daemon)",
              file=sys.stderr)
        return 0
    log_file = a.log_file or env("log_file") or \
        default_log_file(f"recover-{key_of(cache_dir)}")
    opts = Options(mountpoint=f"(recovery of {cache_dir})", backing=backing, cache_dir=cache_dir,
                   cache_size=left.pool_size, log_file=log_file, **settings)
    from ..daemon import offline
    prog = Progress()

    def notify(msg: str) -> None:
        if msg.startswith("progress "):
            prog.update(msg[len("progress "):])
    print(f"acpfs: recovering {safe(cache_dir)} into {safe(backing)} (log {safe(log_file)})",
          file=sys.stderr)
    try:
        code = offline.recover_offline(opts, notify)
    except (RuntimeError, OSError, ValueError) as e:
        prog.done()
        raise Failure(f"cannot recover {cache_dir}: {e} (log: {log_file})") from None
    prog.done()
    if code:
        print(f"acpfs: stopped before everything was persisted; {safe(cache_dir)} keeps the rest "
              f"(run acpfs recover again; log: {safe(log_file)})", file=sys.stderr)
        # an upload may still hang in the backing (a thread that cannot be stopped): the
        # journal and the log are closed, nothing is left to wait for
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)
    print(f"acpfs: everything {safe(cache_dir)} held is persisted in {safe(backing)}",
          file=sys.stderr)
    return 0


def places(a: argparse.Namespace) -> tuple[str, str]:
    """(backing, cache directory), absolute and checked: both exist, apart, and the cache
    directory is not held by a live daemon (checked again by the daemon, under its lock)."""
    for opt in ("backing", "cache_dir", "log_file", "log_level"):
        if getattr(a, opt, None) is not None and not getattr(a, opt).strip():
            raise UsageError(f"--{opt.replace('_', '-')} is empty")
    if not os.path.isdir(a.backing):
        raise UsageError(f"backing directory {a.backing} does not exist or is not a directory")
    backing = os.path.realpath(a.backing)
    named = a.cache_dir or env("cache_dir")
    cache_dir = os.path.realpath(named or default_cache_dir(backing))
    if named and not os.path.isdir(cache_dir):
        raise UsageError(f"cache directory {named} does not exist or is not a directory")
    if inside(cache_dir, backing) or inside(backing, cache_dir):
        raise UsageError(f"cache directory {cache_dir} and backing directory {backing} hold "
                         f"one another")
    return backing, cache_dir


def add_recover_command(sub, add_global_order_options) -> None:
    r = sub.add_parser("recover", help="persist what a dead daemon left in a cache directory, "
                       "without mounting",
                       description="Persist, in order, the changes a dead daemon left in its cache "
                       "directory (its journal and the content it names) to the backing directory, "
                       "as the next mount would, without mounting: global order is kept across "
                       "nodes, progress is shown, and the cache directory is removed once all of "
                       "it is persisted. Exit status 0 then (also when there is nothing to "
                       "recover), 1 if stopped (Ctrl-C: the rest stays in the cache directory), "
                       "2 for bad usage. The backing must be the one the dead daemon mounted.")
    r.add_argument("--backing", required=True, help="the backing directory the dead daemon mounted")
    r.add_argument("--cache-dir", help="the dead daemon's cache directory (default: the default "
                   "cache directory of BACKING, as acpfs mount chooses it)")
    r.add_argument("--flush-workers", type=int, help="parallel uploads to the backing")
    r.add_argument("--log-level", help="daemon log level (default info)")
    r.add_argument("--log-file", help="log of the recovery (default: next to the mounts' logs)")
    add_global_order_options(r)
    r.set_defaults(fn=cmd_recover)
