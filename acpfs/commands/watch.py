"""``acpfs status --watch``: one line per interval with what a mount did in it, as rates,
until interrupted (or ``--count`` lines), in the manner of vmstat.

Columns (docs/operations.md, "Watching a mount"):

- ``queued/s``: bytes of files handed to the flusher per second: files closed with changes
  (and files persisted while still open), counted at their size when queued
  (``queued_since_mount``). This is what the programs wrote, as the flusher sees it; the
  kernel writes passed through are not seen one by one.
- ``persisted/s`` and ``files/s``: bytes and files that landed in the backing per second
  (``persisted_since_mount``).
- ``queue``: operations not yet applied to the backing, and how that changed.
- ``unsaved``: bytes not yet in the backing (dirty and queued), and the age of the oldest.
- ``errors``: failing operations now; a held queue (global order) is shown as ``held``.

Rates come from the counters of two status documents, divided by the time between them; a
daemon that restarted (another pid) starts its counters again: the line says so.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from . import client
from ..errors import Failure
from ..config import format_size
from ..config import age

HEADER = (f"{'time':<8} {'queued/s':>10} {'persisted/s':>11} {'files/s':>7} {'queue':>7} "
          f"{'(change)':>8} {'unsaved':>10} {'oldest':>7}  errors")
HEADER_EVERY = 20   # lines, as vmstat repeats its header


def rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str:
    """What happened between two status documents of the same daemon, ``seconds`` apart."""
    queued = after["queued_since_mount"]["bytes"] - before["queued_since_mount"]["bytes"]
    persisted = after["persisted_since_mount"]["bytes"] - before["persisted_since_mount"]["bytes"]
    files = after["persisted_since_mount"]["files"] - before["persisted_since_mount"]["files"]
    ops = after["queue"]["pending_ops"]
    change = ops - before["queue"]["pending_ops"]
    unsaved = after["dirty"]["bytes"] + after["flushing"]["bytes"]
    oldest = after["oldest_dirty_age_s"]
    trouble = f"{len(after['errors'])} failing" if after["errors"] else "none"
    if (after.get("peers") or {}).get("held"):
        trouble += ", held for global order"
    if not after.get("flusher_alive", True):
        trouble += ", FLUSHER DEAD"
    return (f"{time.strftime('%H:%M:%S')} {format_size(rate(queued, seconds)):>10} "
            f"{format_size(rate(persisted, seconds)):>11} {rate(files, seconds):>7.1f} "
            f"{ops:>7} {change:>+8} {format_size(unsaved):>10} "
            f"{'-' if oldest is None else age(oldest):>7}  {trouble}")


def watch(mountpoint: str, interval: float, count: int | None, out: TextIO = sys.stdout,
          read_status: Callable[[str], dict[str, Any]] = client.read_status,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Print a line every ``interval`` seconds (``count`` lines, or until interrupted).
    A daemon gone meanwhile ends it: Failure (exit 1)."""
    before = read_status(mountpoint)
    then = time.monotonic()
    shown = 0
    print(f"{mountpoint}: every {interval:g}s (Ctrl-C to stop)", file=out)
    while count is None or shown < count:
        sleep(interval)
        try:
            after = read_status(mountpoint)
        except client.StaleMount:
            raise Failure(f"{mountpoint}: the daemon of this mount is gone; run "
                          f"'acpfs umount {mountpoint}'") from None
        now = time.monotonic()
        if shown % HEADER_EVERY == 0:
            print(HEADER, file=out)
        if after["pid"] != before["pid"] or after["uptime_s"] < before["uptime_s"]:
            print(f"{time.strftime('%H:%M:%S')} a new daemon (pid {after['pid']}) serves the "
                  "mount: its counters start again", file=out)
        else:
            print(line(before, after, now - then), file=out)
        out.flush()
        before, then = after, now
        shown += 1
    return 0
