"""The unit tier's harness: an op log (with or without a journal), a cache and its flusher
over a FaultyBacking, no mount."""

from __future__ import annotations

import os
import time
from pathlib import Path

from acpfs.cache.cache import Cache
from acpfs.flusher.flusher import Flusher
from acpfs.cluster.globalorder import GlobalOrder
from acpfs.oplog.journal import Journal
from acpfs.store.filestore import MemFiles
from acpfs.oplog.log import OpLog
from acpfs.store.pool import Pool
from faulty import FaultyBacking

BS = 4096


def memory_files() -> bool:
    """The content store the unit tier runs on, as a mount would choose it: memory files
    (the passthrough path), or the pool with ACPFS_PASSTHROUGH=off (the daemon's path:
    ./tools/test-daemon-path)."""
    return os.environ.get("ACPFS_PASSTHROUGH", "auto").lower() != "off"


def make_store(cache_dir: Path, size: int, block_size: int = BS, unit: int | None = None):
    """The store of ``memory_files()``, or the one a journal names (``unit``: its block size)."""
    files = memory_files() if unit is None else unit == 0
    if files:
        return MemFiles(str(cache_dir), size)
    return Pool(str(cache_dir / "pool"), size, block_size)


class Parts:
    """An op log, a cache and its flusher over a FaultyBacking, built as the daemon builds
    them (daemon.Daemon.build); ``journal``: the op log journals; ``peers``: global order
    (a ``Peers`` or a stand-in)."""

    def __init__(self, root: Path, blocks: int = 64, journal: bool = False, workers: int = 2,
                 peers=None) -> None:
        self.back = root / "back"
        self.back.mkdir(exist_ok=True)
        self.cache_dir = root / "cache"
        self.cache_dir.mkdir(exist_ok=True)
        self.store = make_store(self.cache_dir, blocks * BS)
        self.store.claim_refs([])
        self.backing = FaultyBacking(str(self.back))
        self.journal = Journal(str(self.cache_dir), self.store.unit, self.store.limit,
                               self.backing.instance) if journal else None
        self.oplog = OpLog(self.store, self.journal)
        self.cache = Cache(self.oplog, self.backing, self.store)
        order = GlobalOrder(peers, self.oplog) if peers is not None else None
        self.flusher = Flusher(self.oplog, self.cache, self.backing, order, workers=workers)
        self.flusher.start()
        self.cache.coherence.attach_listing(self.cache.inodes.root, self.cache.coherence.list_backing(self.cache.inodes.root))

    def drain(self, seq: int | None = None, timeout: float = 30) -> None:
        seq = self.oplog.seq if seq is None else seq
        deadline = time.monotonic() + timeout
        while self.oplog.applied_seq < seq:
            assert time.monotonic() < deadline, "flusher did not drain"
            time.sleep(0.002)

    def close(self) -> None:
        self.backing.clear()
        self.flusher.stop(drain=True, timeout=30)
        if self.journal is not None:
            self.journal.close()
        self.store.close()
        self.backing.close()


def write_file(cache: Cache, name: bytes, data: bytes, parent=None):
    """Create ``name`` and write ``data`` into it; the file stays open for writing."""
    node = cache.names.create(parent or cache.inodes.root, name, 0o644, 0, 0)
    cache.files.open(node, True, False)
    cache.files.write(node, 0, data)
    return node
