"""The journal: what a daemon killed with SIGKILL leaves for the next one.

Two files next to the pool in the cache directory (tmpfs by default, so they outlive the
process but not the machine):

    journal   a header, then one record per change made through the mount, appended in
              mount order before the request that made the change is answered
    applied   the seq of the last operation the flusher applied to the backing (8 bytes)

File contents are not copied into the journal: a record names the pool blocks that hold
them, and those blocks are immutable while a record needs them (snapshots hold references,
see ``types.Snapshot``). So recovery needs the pool file, the journal and the applied
counter, and finds all three in the cache directory.

Records (``Record``, encoded as ``marshal`` tuples, each framed by its length and a CRC32;
a torn record at the end is ignored, it was never acknowledged): one per queued operation
(``seq`` > 0, kinds as in ``types.OpKind``), and per-file state records (``seq`` 0):
"flushed" (its last writer called close(): its content then), "dirty" (it got unsaved
changes: it is open for writing) and "clean" (its "flushed"/"dirty" record no longer
matters). ``LAYOUT`` gives each kind's fields in the order they are stored; ``OPTIONAL``
the fields a record may have after them (a content record of a file with hard links: its
other names).

Invariants:
- A record is written before the FUSE request that caused it is answered; ``OpLog.lock``
  serializes appends, so the file holds them in seq order.
- ``applied`` is written before the op's block references are dropped, so every block named
  by a record with seq > applied still holds the bytes the record describes.
- The journal is cut back to its header only when no op is queued (all are in the backing:
  the sequencer says so through ``applied(seq, idle=True)``), by the next append, which
  first writes again the "dirty"/"flushed" records of files still in those states
  (``append``'s ``live``: ``OpLog._live_records``); appends run on the FUSE thread, which
  owns the paths.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import json
import logging
import marshal
import os
import struct
import zlib
from typing import Callable, Iterator

log = logging.getLogger(__name__)

MAGIC = b"ACPFSJ02"
HEADER = struct.Struct("<8sQQ16s")  # magic, block size, pool size, daemon instance
FRAME = struct.Struct("<II")        # payload length, crc32 of the payload
JOURNAL = "journal"
RECOVERING = "journal.recovering"   # the journal a recovery is replaying
APPLIED = "applied"
DIRECT = "direct-writes"            # paths saved straight to the backing while no daemon ran


FLUSHED = "flushed"
DIRTY = "dirty"
CLEAN = "clean"
CONTENT = ("size", "mode", "uid", "gid", "times", "xattrs", "blocks", "staged_name")
# Each kind's fields after (seq, kind, ino), in stored order. Never change an existing kind's:
# the next daemon, of a newer version after an upgrade, replays the journal a dead one left.
LAYOUT: dict[str, tuple[str, ...]] = {
    "publish": ("path",) + CONTENT,
    FLUSHED: ("path",) + CONTENT,
    "mkdir": ("path", "mode", "uid", "gid"),
    "symlink": ("path", "target", "uid", "gid"),
    "mknod": ("path", "mode", "uid", "gid", "size"),   # size: the device number
    "unlink": ("path",),
    "rmdir": ("path",),
    "rename": ("src_path", "path"),
    "link": ("src_path", "path"),         # src_path: a name the file had; path: the new one
    "setattr": ("path", "mode", "uid", "gid", "times"),
    "xattr": ("path", "key", "value"),
    DIRTY: ("path",),
    CLEAN: (),
}
CONTENT_KINDS = ("publish", FLUSHED)
# Fields a record of these kinds may have after those of LAYOUT (added later: a record
# without them reads as before): a file's other names (hard links), paths like ``path``.
OPTIONAL: dict[str, tuple[str, ...]] = {"publish": ("links",), FLUSHED: ("links",)}


def pack_blocks(blocks: list[int]) -> bytes:
    return array.array("i", blocks).tobytes()


def unpack_blocks(data: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(data)
    return a.tolist()


@dataclasses.dataclass
class Record:
    """One journal record. ``path`` is the mount path (relative, b"" for the root; None for
    a file deleted meanwhile); for a rename it is the destination and ``src_path`` the source.
    Which other fields a kind uses is in ``LAYOUT``."""
    seq: int                 # the op's seq; 0 for file-state records
    kind: str                # an OpKind value, FLUSHED, DIRTY or CLEAN
    ino: int
    path: bytes | None = None
    src_path: bytes | None = None
    size: int = 0
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    times: tuple[int, int] | None = None
    xattrs: dict[bytes, bytes] = dataclasses.field(default_factory=dict)
    blocks: list[int] = dataclasses.field(default_factory=list)
    staged_name: bytes = b""   # the staged file holding the content, if written through
    target: bytes = b""
    key: bytes = b""
    value: bytes | None = None
    links: list[bytes] = dataclasses.field(default_factory=list)   # a file's other names

    def encode(self) -> bytes:
        fields = [getattr(self, f) for f in LAYOUT[self.kind]]
        if "blocks" in LAYOUT[self.kind]:
            fields[LAYOUT[self.kind].index("blocks")] = pack_blocks(self.blocks)
        if self.links and "links" in OPTIONAL.get(self.kind, ()):
            fields.append(list(self.links))
        return marshal.dumps((self.seq, str(self.kind), self.ino, *fields))

    @classmethod
    def decode(cls, payload: bytes) -> Record:
        seq, kind, ino, *values = marshal.loads(payload)
        names = LAYOUT.get(kind)
        if names is not None and len(values) > len(names):
            names = names + OPTIONAL.get(kind, ())
        if names is None or len(names) != len(values):
            raise ValueError(f"unknown journal record {kind!r} with {len(values)} fields")
        fields = dict(zip(names, values))
        if "blocks" in fields:
            fields["blocks"] = unpack_blocks(fields["blocks"])
        if fields.get("times") is not None:
            fields["times"] = tuple(fields["times"])
        return cls(seq=seq, kind=kind, ino=ino, **fields)


class Journal:
    """The journal of a running daemon. Every method is called with ``OpLog.lock`` held.

    A journal that cannot be written means that a crash would lose acknowledged data: the
    first failure is logged at ERROR, ``error`` says why (status shows it), and the mount
    keeps serving; the error clears when the journal is whole again: at the next cut-back,
    once every queued op is in the backing.
    """

    def __init__(self, cache_dir: str, block_size: int, pool_size: int, instance: str = "") -> None:
        self.path = os.path.join(cache_dir, JOURNAL)
        # the instance names the daemon's temporary files: the next daemon removes the
        # leftovers of this one, and no one else's (backing.py)
        self.header = HEADER.pack(MAGIC, block_size, pool_size, instance.encode())
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                          0o600)
        os.write(self.fd, self.header)
        self.size = len(self.header)
        self.applied_fd = os.open(os.path.join(cache_dir, APPLIED),
                                  os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.idle = False             # no op queued since the last applied(): cut back next
        self.error: str | None = None

    def append(self, record: Record, live: Callable[[], list[Record]] = list) -> None:
        """Write ``record``. Once everything recorded is applied (``idle``), the journal is
        cut back first, to ``live()``: the records of the files it must still know (the
        "dirty"/"flushed" ones, OpLog.journaled)."""
        try:
            if self.idle:
                self._reset()
                for rec in live():
                    self._write(rec)
                self.idle = False
                # Invariant: ``error`` stays set from a failed append until here. A failed
                # append drops its record, so the journal lacks an op the flusher may not
                # have applied; only a cut-back (every op applied, the live records written
                # again) makes it whole. A later successful append does not.
                self.error = None
            self._write(record)
        except OSError as e:
            if self.error is None:
                log.error("cannot write the journal %s (%s): changes are still persisted, but a "
                          "daemon crash now would lose the ones not yet in the backing",
                          self.path, e)
            self.error = str(e)

    def _write(self, record: Record) -> None:
        payload = record.encode()
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

    def applied(self, seq: int, idle: bool = False) -> None:
        """The sequencer applied op ``seq``; ``idle``: nothing is queued after it."""
        os.pwrite(self.applied_fd, seq.to_bytes(8, "little"), 0)
        if idle:
            self.idle = True

    def _reset(self) -> None:
        """Everything recorded is in the backing: drop it."""
        if self.size > len(self.header):
            os.ftruncate(self.fd, len(self.header))
            os.lseek(self.fd, len(self.header), os.SEEK_SET)
            self.size = len(self.header)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.applied_fd)


class Leftover:
    """What a dead daemon left in a cache directory."""

    def __init__(self, block_size: int, pool_size: int, records: list[Record], applied: int,
                 torn: int, direct: set[bytes] | None = None, instance: str | None = None) -> None:
        self.instance = instance   # the dead daemon's (None: its journal named none)
        self.block_size = block_size
        self.pool_size = pool_size
        self.records = records
        self.applied = applied
        self.torn = torn           # bytes of a record cut short at the end (never acknowledged)
        self.direct = direct or set()   # paths saved straight to the backing meanwhile

    @property
    def last_seq(self) -> int:
        return max([r.seq for r in self.records] + [self.applied])


def _frames(data: bytes, start: int) -> Iterator[tuple[int, Record]]:
    pos = start
    while pos + FRAME.size <= len(data):
        n, crc = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size:pos + FRAME.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            return
        yield pos + FRAME.size + n, Record.decode(payload)
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
        if data[:8] == MAGIC and len(data) >= HEADER.size:
            _, block_size, pool_size, raw = HEADER.unpack_from(data)
            instance, start = raw.rstrip(b"\0").decode("ascii", "replace") or None, HEADER.size
        elif len(data) < HEADER.size:
            return None
        else:
            raise ValueError(f"{path} is not an acpfs journal (or from an incompatible version)")
        records, end = [], start
        for end, rec in _frames(data, start):
            records.append(rec)
        try:
            with open(os.path.join(cache_dir, APPLIED), "rb") as f:
                applied = int.from_bytes(f.read(8) or b"\0", "little")
        except FileNotFoundError:
            applied = 0
        return Leftover(block_size, pool_size, records, applied, len(data) - end,
                        read_direct_writes(cache_dir), instance)
    return None


def read_instance(cache_dir: str) -> str | None:
    """The daemon instance named by the journal in ``cache_dir`` (one being recovered first),
    without reading the records; None if there is none (or it names none)."""
    for name in (RECOVERING, JOURNAL):
        try:
            with open(os.path.join(cache_dir, name), "rb") as f:
                head = f.read(HEADER.size)
        except OSError:
            continue
        if len(head) == HEADER.size and head[:8] == MAGIC:
            return HEADER.unpack(head)[3].rstrip(b"\0").decode("ascii", "replace") or None
        return None
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
    fd = os.open(os.path.join(cache_dir, DIRECT), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                 | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (json.dumps(path) + "\n").encode())
    finally:
        os.close(fd)


def read_direct_writes(cache_dir: str) -> set[bytes]:
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
