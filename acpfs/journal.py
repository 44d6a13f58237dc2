"""The journal: what a daemon killed with SIGKILL leaves for the next one.

Two files next to the pool in the cache directory (tmpfs by default, so they outlive the
process but not the machine):

    journal   a header, then one record per change made through the mount, appended in
              mount order before the request that made the change is answered
    applied   the seq of the last operation the flusher applied to the backing (8 bytes)

File contents are not copied into the journal: a record names the pool blocks that hold
them, and those blocks are immutable while a record needs them (snapshots hold references,
see ``cache.Snapshot``). So recovery needs the pool file, the journal and the applied
counter, and finds all three in the cache directory.

Records (``marshal``-encoded tuples, each framed by its length and a CRC32; a torn record
at the end is ignored, it was never acknowledged):

    (seq, kind, ino, path, ...)   an operation queued for the flusher (kinds as in flusher.Op)
    (0, "flushed", ino, path, ...)  a file's last writer called close(): its content then
    (0, "dirty", ino, path)        a file got unsaved changes (it is open for writing)
    (0, "clean", ino)              the file's "flushed"/"dirty" record no longer matters

Invariants:
- A record is written before the FUSE request that caused it is answered; ``Flusher.cond``
  (= ``Cache.lock``) serializes appends, so the file holds them in seq order.
- ``applied`` is written before the op's block references are dropped, so every block named
  by a record with seq > applied still holds the bytes the record describes.
- The journal is cut back to its header only when no op is queued (all are in the backing),
  and right away the "dirty"/"flushed" records of files still in those states are written
  again (``Flusher._journal``), on the FUSE thread, which owns the paths.
"""

from __future__ import annotations

import array
import errno
import logging
import marshal
import os
import struct
import zlib
from typing import Any, Iterator

log = logging.getLogger(__name__)

MAGIC = b"ACPFSJ01"
HEADER = struct.Struct("<8sQQ")     # magic, block size, pool size
FRAME = struct.Struct("<II")        # payload length, crc32 of the payload
JOURNAL = "journal"
RECOVERING = "journal.recovering"   # the journal a recovery is replaying
APPLIED = "applied"
DIRECT = "direct-writes"            # paths saved straight to the backing while no daemon ran


def pack_blocks(blocks: list[int]) -> bytes:
    return array.array("i", blocks).tobytes()


def unpack_blocks(data: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(data)
    return a.tolist()


class Journal:
    """The journal of a running daemon (appends; the caller holds ``Cache.lock``)."""

    def __init__(self, cache_dir: str, block_size: int, pool_size: int) -> None:
        self.path = os.path.join(cache_dir, JOURNAL)
        self.header = HEADER.pack(MAGIC, block_size, pool_size)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                          0o600)
        os.write(self.fd, self.header)
        self.size = len(self.header)
        self.applied_fd = os.open(os.path.join(cache_dir, APPLIED),
                                  os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.reset_wanted = False   # set by the flusher when idle; done on the next append

    def append(self, record: tuple) -> None:
        payload = marshal.dumps(record)
        data = FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            n = os.write(self.fd, data)
        except OSError:
            n = -1
            raise
        finally:
            if n != len(data):   # never leave a torn record that later ones would follow
                os.ftruncate(self.fd, self.size)
                os.lseek(self.fd, self.size, os.SEEK_SET)
        if n != len(data):
            raise OSError(errno.ENOSPC, f"No space left on device (journal record cut short at "
                          f"{n} of {len(data)} bytes)")
        self.size += n

    def applied(self, seq: int) -> None:
        os.pwrite(self.applied_fd, seq.to_bytes(8, "little"), 0)

    def reset(self) -> None:
        """Everything recorded is in the backing: drop it (hold Cache.lock)."""
        if self.size > len(self.header):
            os.ftruncate(self.fd, len(self.header))
            os.lseek(self.fd, len(self.header), os.SEEK_SET)
            self.size = len(self.header)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.applied_fd)


class Leftover:
    """What a dead daemon left in a cache directory."""

    def __init__(self, block_size: int, pool_size: int, records: list[tuple], applied: int,
                 torn: int, direct: set[bytes] | None = None) -> None:
        self.block_size = block_size
        self.pool_size = pool_size
        self.records = records
        self.applied = applied
        self.torn = torn           # bytes of a record cut short at the end (never acknowledged)
        self.direct = direct or set()   # paths saved straight to the backing meanwhile

    @property
    def last_seq(self) -> int:
        return max([r[0] for r in self.records] + [self.applied])


def _frames(data: bytes, start: int) -> Iterator[tuple[int, Any]]:
    pos = start
    while pos + FRAME.size <= len(data):
        n, crc = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size:pos + FRAME.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            return
        yield pos + FRAME.size + n, marshal.loads(payload)
        pos += FRAME.size + n


def read_leftover(cache_dir: str) -> Leftover | None:
    """The journal of a dead daemon (one being recovered first), or None if there is none."""
    for name in (RECOVERING, JOURNAL):
        path = os.path.join(cache_dir, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        if len(data) < HEADER.size:
            return None
        magic, block_size, pool_size = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(f"{path} is not an acpfs journal (or from an incompatible version)")
        records, end = [], HEADER.size
        for end, rec in _frames(data, HEADER.size):
            records.append(rec)
        try:
            with open(os.path.join(cache_dir, APPLIED), "rb") as f:
                applied = int.from_bytes(f.read(8) or b"\0", "little")
        except FileNotFoundError:
            applied = 0
        return Leftover(block_size, pool_size, records, applied, len(data) - end,
                        read_direct_writes(cache_dir))
    return None


def start_recovery(cache_dir: str) -> None:
    """Keep the dead daemon's journal aside while a new one is written (a crash during the
    recovery then recovers from the same journal again)."""
    src, dst = os.path.join(cache_dir, JOURNAL), os.path.join(cache_dir, RECOVERING)
    if not os.path.exists(dst):
        os.rename(src, dst)


def finish_recovery(cache_dir: str) -> None:
    """The replayed journal is not needed any more (nor one a failed start left behind)."""
    try:
        os.unlink(os.path.join(cache_dir, RECOVERING))
    except FileNotFoundError:
        pass


def record_direct_write(cache_dir: str, path: str) -> None:
    """``acpfs.torch`` saved ``path`` (relative to the mount) straight to the backing while
    the daemon was dead or hung: a later recovery must not replay older content over it."""
    import json
    fd = os.open(os.path.join(cache_dir, DIRECT), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                 | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (json.dumps(path) + "\n").encode())
    finally:
        os.close(fd)


def read_direct_writes(cache_dir: str) -> set[bytes]:
    import json
    try:
        with open(os.path.join(cache_dir, DIRECT), "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return set()
    out = set()
    for line in lines:
        try:
            out.add(os.fsencode(json.loads(line)))
        except ValueError:
            continue   # a line cut short by a crash
    return out


def forget_direct_writes(cache_dir: str) -> None:
    try:
        os.unlink(os.path.join(cache_dir, DIRECT))
    except FileNotFoundError:
        pass
