"""Driving ``acpfs.core.requests.Core`` under trio without FUSE (as S3QL's tests/t3_fs_api.py drives its
Operations): a harness's ``Parts``, a ``MountInfo``, the core's background tasks in a
nursery, and a time limit on everything. Every hang injected into the backing is released
before the nursery closes (worker threads held in the backing would keep it open)."""

from __future__ import annotations

import os
import time
import types
from typing import Awaitable, Callable

import trio

from acpfs.config import Options
from acpfs.core.control import MountInfo
from acpfs.core.requests import Core
from acpfs.node import ROOT_INODE

ROOT = ROOT_INODE
CALLER = types.SimpleNamespace(uid=0, gid=0, umask=0o022)   # what pyfuse3's RequestContext has


def mount_info(h, **options) -> MountInfo:
    """The mount's facts over harness ``h``; ``options``: fields of ``Options`` that differ
    from these (a short cache-full timeout, no long-open persisting, 2 flush workers)."""
    settings = {"cache_full_timeout": 1.0, "persist_open_after": 0.0, "flush_workers": 2, **options}
    return MountInfo(Options(mountpoint=str(h.back.parent / "mnt"), backing=str(h.back),
                             cache_dir=str(h.cache_dir), cache_size=h.store.limit, log_file="-",
                             **settings))


def run(h, test: Callable[[Core], Awaitable[None]], *, timeout: float = 15, **options) -> Core:
    """``await test(core)`` with a Core over harness ``h``'s flusher (``options``: see
    ``mount_info``); fails after ``timeout``."""
    core = Core(h.flusher, mount_info(h, **options))

    async def main() -> None:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                core.start(nursery)
                try:
                    await test(core)
                finally:
                    h.backing.clear()
                    nursery.cancel_scope.cancel()
    trio.run(main)
    return core


async def create(core: Core, name: bytes, parent: int = ROOT, mode: int = 0o644,
                 flags: int = os.O_WRONLY):
    """(file handle, node) of a new file."""
    fh, node, _ = await core.create(parent, name, mode, flags, CALLER)
    return fh, node


async def write(core: Core, fh: int, data: bytes, off: int = 0, chunk: int = 1 << 20) -> None:
    for pos in range(0, len(data), chunk):
        piece = data[pos:pos + chunk]
        assert await core.handles.write(fh, off + pos, piece) == len(piece)


async def read(core: Core, fh: int, size: int, off: int = 0) -> bytes:
    return bytes(await core.handles.read(fh, off, size))


async def close(core: Core, fh: int) -> None:
    """close(): FLUSH, then RELEASE."""
    core.handles.flush(fh)
    await core.handles.release(fh)


async def drain(h, timeout: float = 10) -> None:
    """Until the flusher has applied everything queued so far (trio sleeps between looks)."""
    seq = h.cache.oplog.seq
    deadline = time.monotonic() + timeout
    while h.flusher.oplog.applied_seq < seq:
        assert time.monotonic() < deadline, "flusher did not drain"
        await trio.sleep(0.002)


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ at every block offset (a misplaced block shows)."""
    return bytes((i * 7 + seed + (i >> 12)) & 0xFF for i in range(n))
