"""The node records of global order (docs/design.md, "Global order across nodes"): what a
record says and how its name is written and parsed, and the records directory as this daemon
reads it; what the records mean (the rule, leases, promises) is ``peers.Peers``'.

- The format: each node keeps one record in ``<backing>/.acpfs-nodes/``, an empty file whose
  *name* holds everything (``RecordName``: instance, version, frontier, heartbeat, state,
  label, and the address of its peer plane where it serves one: acpfs/cluster/plane.py),
  renamed to a new name to update it. The states: ``UP`` (changes pending), ``IDLE``
  (nothing pending), ``LEFT`` (unmounted after persisting everything). Times in a name are
  whole microseconds (``whole_us``); the label is for humans (``safe_label``).
- Whose records count (``RecordsDir``): the records directory is 1777, so that every user's
  mounts of a backing keep records there, and a record is believed only if its file belongs
  to this daemon's user, to root, or to the owner the backing gives this daemon's own record
  (an NFS export that squashes root). Any other record is ignored, with a WARNING naming the
  file and its owner: another user could otherwise plant a record whose frontier never
  passes and whose heartbeat never ages, and hold every change of the job. The sticky bit
  keeps other users from renaming or removing a counted record. Owners are looked up once
  per record file (``_counted``: by inode, which a rename keeps), not at every listing.
- I/O: every system call on the records goes through ``Backing`` (acpfs/backing/records.py),
  with its stale-handle reopen; a unit test can hand ``Peers`` a wrapped backing that fails
  or hangs any one of them (tests/unit/faulty.py). ``RecordsDir`` takes the daemon's
  ``Backing``, or the backing's path, and then opens one of its own at its first I/O (in the
  thread that does it) and closes it at ``close``.

Threads and locks: ``RecordsDir`` is called by ``Peers`` only: by a thread at mount
(``Daemon._records``), then by ``Peers``' thread (``acpfs-peers``), and by a worker thread
that writes the record in ``Peers.announce`` (``create``, under ``Peers._wlock``). Its one
lock, ``_opening``, guards the opening and closing of its own ``Backing`` and is never held
across I/O. ``owners`` only grows (``set.add``); ``_owner_of`` and ``_ignored`` are used by
``names``, which the thread at mount and then ``acpfs-peers`` call, and ``_owner_of`` is
replaced whole by each listing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
import threading

from ..backing.backing import NODES_DIR, Backing
from ..userdirs import owner_name

log = logging.getLogger(__name__)

UP, IDLE, LEFT = "up", "idle", "left"    # pending changes / nothing pending / unmounted
RECORD = re.compile(rb"([0-9a-f]{12})\.(\d+)\.(\d+)\.(\d+)\.(up|idle|left)\.(?:@([0-9a-f]{2,120})\.)?(.*)",
                    re.S)
LABEL_MAX = 120
ADDRESS_MAX = 60   # characters of HOST:PORT in a record (120 hex digits)


@dataclasses.dataclass(frozen=True)
class RecordName:
    """One node's record, as the name of an empty file in ``.acpfs-nodes``:
    ``<instance>.<version>.<frontier us>.<heartbeat us>.<state>.[@<address>.]<label>``, the
    address (``HOST:PORT`` of its peer plane, in hex: a host name has dots) only where it
    serves one (a label written by ``safe_label`` has no dot, so it never reads as one)."""
    instance: str
    version: int
    frontier: float    # the writer's clock: everything it acknowledged before is durable
    heartbeat: float   # the writer's clock when it wrote this record
    state: str
    label: str         # for humans: host name and mount point
    address: str = ""  # HOST:PORT of its peer plane (--peers-listen), "" where it has none

    def encode(self) -> bytes:
        where = b"@%s." % self.address.encode().hex().encode() if self.address else b""
        head = b"%s.%d.%d.%d.%s.%s" % (self.instance.encode(), self.version,
                                       round(self.frontier * 1e6), round(self.heartbeat * 1e6),
                                       self.state.encode(), where)
        # the label gives way to the address: a name is at most NAME_MAX (255) bytes
        return head + self.label.encode()[:min(LABEL_MAX, 255 - len(head))]

    @classmethod
    def parse(cls, name: bytes) -> RecordName | None:
        m = RECORD.fullmatch(name)
        if m is None:
            return None
        inst, ver, front, beat, state, where, label = m.groups()
        try:
            address = bytes.fromhex(where.decode()).decode() if where else ""
        except ValueError:   # odd digits, not UTF-8: a record that serves nothing
            address = ""
        return cls(inst.decode(), int(ver), int(front) / 1e6, int(beat) / 1e6, state.decode(),
                   label.decode(errors="replace"), address)


def whole_us(t: float) -> float:
    return round(t * 1e6) / 1e6


def safe_label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_:@+,=-]", "_", text)[:LABEL_MAX]


class RecordsDir:
    """The records directory of ``backing`` (the daemon's ``Backing``, or the backing
    directory's path: a ``Backing`` of its own is then opened at the first I/O, and closed
    at ``close``), and whose records in it count (``owners``)."""

    def __init__(self, backing: Backing | str) -> None:
        self._own = isinstance(backing, str)     # opened here, closed at close
        self._backing: Backing | None = None if isinstance(backing, str) else backing
        self._opening = threading.Lock()
        self.root = backing if isinstance(backing, str) else backing.root
        self.dir = os.path.join(self.root, os.fsdecode(NODES_DIR))   # for messages
        self.owners = {0, os.geteuid()}  # whose records count; + the backing's owner of ours
        self._owner_of: dict[int, tuple[bytes, int]] = {}   # inode -> (instance, owner) seen
        self._ignored: set[tuple[bytes, int]] = set()       # (instance, owner) warned about

    def backing(self) -> Backing:
        """The ``Backing`` the records are kept in (opened now if only its path was given;
        not under ``_opening``, which no thread holds across I/O)."""
        back = self._backing
        if back is None:
            fresh: Backing | None = Backing(self.root)
            with self._opening:
                if self._backing is None:
                    self._backing, fresh = fresh, None
                back = self._backing
            if fresh is not None:   # another thread opened one meanwhile
                fresh.close()
        assert back is not None
        return back

    def close(self) -> None:
        """Close the ``Backing`` opened here, if any (not the daemon's)."""
        with self._opening:
            if self._own and self._backing is not None:
                self._backing.close()
                self._backing = None

    def names(self, warn: bool = True) -> list[bytes]:
        """The names of the records that count in the records directory (``_counted``). It
        is opened anew each time, by name (``Backing.list_records``): an NFS client
        revalidates it then (close-to-open), so the listing is current."""
        for _ in range(3):   # a record renamed under the listing: list again
            counted, moved = self._counted(self.backing().list_records(), warn)
            if not moved:
                break
        return counted

    def _counted(self, listed: list[tuple[bytes, int]], warn: bool) -> tuple[list[bytes], bool]:
        """The record names of a listing ((name, inode) pairs) whose files belong to an owner
        in ``owners``, and whether a record was renamed between the listing and the look at
        its owner (its new name is in a listing started after: the caller lists again). The
        others are ignored, each (instance, owner) with one WARNING if ``warn`` (not before
        this node has written a record: the owner the backing gives it may count too)."""
        counted: list[bytes] = []
        seen: dict[int, tuple[bytes, int]] = {}
        moved = False
        for name, ino in listed:
            inst = name.split(b".", 1)[0]
            if RecordName.parse(name) is None:
                continue
            known = self._owner_of.get(ino) if ino else None
            if known is None or known[0] != inst:     # a new file, or an inode used again
                st = self.backing().stat_record(name)
                if st is None:
                    moved = True
                    continue
                known = (inst, st.st_uid if stat.S_ISREG(st.st_mode) else -1)
            if ino:
                seen[ino] = known
            owner = known[1]
            if owner in self.owners:
                counted.append(name)
            elif warn and known not in self._ignored:
                self._ignored.add(known)
                log.warning("global order: ignoring the node record %s in %s: %s; only records "
                            "of this daemon's user or root count, so it holds nobody back",
                            name.decode(errors="replace"), self.dir,
                            f"it belongs to {owner_name(owner)}" if owner >= 0
                            else "it is not a regular file")
        self._owner_of = seen
        return counted, moved

    def ensure_dir(self) -> None:
        """Make the records directory if it is not there (mode 1777: every user's mounts keep
        records there; the sticky bit keeps each one's own); its owner counts."""
        owner = self.backing().make_records_dir()
        if owner is not None:
            self.owners.add(owner)

    def check_dir(self) -> None:
        """Say so if other users may remove or rename this node's record (after it is
        written: ``owners`` then holds the owner the backing gives this node's files)."""
        st = self.backing().stat_records_dir()
        if stat.S_ISDIR(st.st_mode) and (st.st_uid not in self.owners or (
                st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX)):
            log.warning("global order: the node records directory %s belongs to %s, mode %04o: "
                        "other users can remove or rename this node's record there (the other "
                        "nodes may then stop waiting for it); make it root's or this user's, "
                        "mode 1777", self.dir, owner_name(st.st_uid), stat.S_IMODE(st.st_mode))

    def create(self, name: bytes) -> None:
        """Create the record ``name`` (this node's, written anew); the owner the backing
        gives this daemon's files counts (root squashed by NFS)."""
        try:
            self.owners.add(self.backing().create_record(name))
        except FileNotFoundError:   # the directory itself was removed
            self.ensure_dir()
            self.owners.add(self.backing().create_record(name))
