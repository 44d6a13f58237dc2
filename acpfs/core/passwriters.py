"""What writers the kernel passes through have written: ``count_passthrough_writes``.

Owns nothing: a background task of the trio thread (``Handles.start``) that looks at the
memory files of open writers passed through (``Files.passthrough_writers``), whose writes
never reach the daemon.
"""

from __future__ import annotations

import logging

import trio

from ..cache.admission import Admission
from ..cache.files import Files
from ..config import format_size

log = logging.getLogger(__name__)

PASSTHROUGH_LOOK = 0.5   # s between looks at the files writers passed through have written


async def count_passthrough_writes(files: Files, admission: Admission) -> None:
    """What writers the kernel passes through have written is counted every
    PASSTHROUGH_LOOK seconds (``Files.sync_content``), so that the cache's use in
    ``status`` and the admission of the next writers (``Admission.admit``) are current;
    a cache pushed past its size by them is said once, in the log."""
    over = False
    while True:
        await trio.sleep(PASSTHROUGH_LOOK)
        for node in list(files.passthrough_writers):
            files.sync_content(node)
        admission.check_growth()
        files.trim()
        now_over = files.store.used > files.store.limit
        if now_over and not over:
            log.warning("cache over its size: %s held, %s allowed: files written with "
                        "passthrough grew past what was kept free for them (%d still open); "
                        "new writers take the daemon's path until enough is persisted",
                        format_size(files.store.used), format_size(files.store.limit),
                        len(files.passthrough_writers))
        over = now_over
