"""A daemon without a mount: ``recover_offline`` (``acpfs recover``).

Owns nothing of its own: it strings together the phases of ``daemon.Daemon`` but ``serve``,
built ``headless`` (no mount point, no lock on the backing, no kernel passthrough)."""

from __future__ import annotations

from typing import Callable

from ..config import Options
from .daemon import Daemon
from .process import drain
from .sdnotify import Notifier


def recover_offline(opts: Options, notify: Callable[[str], None]) -> int:
    """``acpfs recover``: persist what a dead daemon left in ``opts.cache_dir`` without
    mounting anything: its journal replayed as a restarted daemon replays it (in its order,
    global order kept: this daemon's record takes over the dead one's), then drained. 0 once
    all of it is in the backing (the cache directory is then removed), 1 if the drain was
    stopped (by a signal: the cache directory keeps what is left)."""
    daemon = Daemon(opts, notify, Notifier(None), headless=True)
    daemon.build()
    daemon.recover()
    notify(f"progress persisting {daemon.summary()}")
    drained = drain(daemon.flusher, lambda: notify(f"progress persisting {daemon.summary()}"))
    return daemon.close(drained)
