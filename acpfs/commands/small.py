"""The small commands: ``acpfs sync`` (wait until changes are durable, on this node or on
every node), ``preload``, ``umount`` (drain, then unmount) and ``temps`` (temporary files
daemons left in a backing)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from .. import mounttable
from ..config import age, format_size, parse_size, safe
from ..errors import Failure, UsageError
from ..mounttable import FSTYPE
from . import client, syncing
from .mount import clean_stale, pid_alive
from .progress import Progress


def cmd_sync(a: argparse.Namespace) -> int:
    if a.replicated:
        if a.all_nodes:
            raise UsageError("--replicated and --all-nodes wait for different things: give one")
        mounts = [client.live_mount(a.path)] if a.path else \
            [m for m in mounttable.acpfs_mounts() if not client.is_stale(m)]
        for mount in mounts:
            syncing.wait_replicated(mount, a.timeout, f"sync --replicated {mount}")
        return 0
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
        client.read_seq(mount)   # tells the daemon a sync waits (its flusher stops giving way)
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
    budget = None if a.max_bytes is None else parse_size(a.max_bytes, "--max-bytes")
    start = time.monotonic()
    done = client.preload(a.paths, max_bytes=budget)
    for line in done.left_out[:20]:
        print(f"acpfs: preload: not loaded: {safe(line)}", file=sys.stderr)
    if len(done.left_out) > 20:
        print(f"acpfs: preload: ... and {len(done.left_out) - 20} more not loaded", file=sys.stderr)
    took = time.monotonic() - start
    print(f"acpfs: preloaded {done.files} files ({format_size(done.nbytes)})"
          + (f"; {len(done.left_out)} did not fit in the cache" if done.left_out else "")
          + (f"; {len(done.over_budget)} not read: past --max-bytes {format_size(budget)}"
             if done.over_budget else "")
          + f"; {took:.1f}s, {format_size(done.nbytes / max(took, 1e-3))}/s", file=sys.stderr)
    return 1 if done.left_out else 0


def cmd_umount(a: argparse.Namespace) -> int:
    stale = client.is_stale(a.mountpoint)
    mountpoint = os.path.abspath(a.mountpoint) if stale else os.path.realpath(a.mountpoint)
    kind = mounttable.mount_type(mountpoint)
    if kind != FSTYPE:
        raise UsageError(f"{a.mountpoint} is not an acpfs mount")
    if client.is_stale(mountpoint):
        clean_stale(mountpoint)
        return 0
    client.read_seq(mountpoint)   # tells the daemon a drain waits (its flusher stops giving way)
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
