"""Which writers the kernel may write for (passthrough), and the sizes that decide it.

The kernel writes a file passed through without asking the daemon, and nothing can take
passthrough back from an open file; an ENOSPC from a size-limited store would break the
promise that a writer never sees one while the backing has room. So what is decided here,
at the open, is all that bounds what writers passed through add to the cache.

Owns:
- ``sizes``: the size each base name had when last seen closed (newest ``NAMES`` names).
  Checkpoints rewrite the same names with the same sizes step after step, in new
  directories (``step_2000/rank3.pt``, ``__3_0.distcp``, ``mp_rank_00/model_optim_rng.pt``),
  so the base name is the key, whatever its directory. Learned when a file is opened that
  nobody writes (a resume reads the names it will write next) and at the last close of a
  writer;
- ``reserved``: the bytes each writer passed through was admitted for, while it is open;
- ``counts``: the decisions, by outcome (status ``cache.writer_opens``, the metrics, the bench).

The rule (``admit``):
1. no writer is passed through while the store holds more than its size;
2. a writer's size is known when its file is reopened without ``O_TRUNC`` (its size now;
   it is admitted only with PASS_WRITER_RESERVE free beyond it, as it may be extended) or
   when its name was seen before (``sizes``), never for an appender (``O_APPEND``: a log grows by what it
   appends); it reserves that size. Of unknown size, on a store in RAM
   (tmpfs: ``Store.in_ram``) it takes the daemon's path, which a full cache makes wait or
   write through; on a store on disk, where the page cache bounds its RAM, it reserves
   PASS_WRITER_RESERVE;
3. it is admitted when the free space, with what persisted files hold, holds its reservation
   beside what every writer passed through still open was promised and has not written
   (``owed``); persisted files are evicted for it at once, least recently used first
   (``Files.reserve``). Every allocation of the daemon's own leaves the promised bytes
   alone (``Files.owed``), so the files the kernel writes fit in the cache's size from the
   first byte to the last, whatever the daemon's path writes meanwhile.
So a store in RAM holds at most its size plus, per writer passed through, what that writer
writes beyond the size its name had; one that grows more than GROWTH past it is said once
in the log (``check_growth``) and its name's new size is reserved from then on.

Threads: the trio thread; the store's space is read under the op log's lock.
"""

from __future__ import annotations

import collections
import logging

from ..config import format_size
from ..node import Node, node_path
from .files import Files

log = logging.getLogger(__name__)

PASS_WRITER_RESERVE = 64 << 20   # bytes a writer of unknown size reserves on a disk store,
                                 # and what a file reopened without O_TRUNC needs free
GROWTH = 64 << 20                # what a writer may write past its reservation unsaid
NAMES = 65536                    # base names whose sizes are kept

PASSED = "passed_through"
OUTCOMES = (PASSED, "unknown_size", "no_room", "over_size")


class Admission:
    def __init__(self, files: Files) -> None:
        self.files = files
        files.owed = self.owed
        self.sizes: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.reserved: dict[int, int] = {}    # inode of a writer passed through -> bytes
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._said: set[int] = set()          # writers whose growth the log has had

    def learn(self, node: Node) -> None:
        """``node``'s size is that of a closed version of its name."""
        if node.is_reg and node.name:
            self.sizes[node.name] = node.size
            self.sizes.move_to_end(node.name)
            if len(self.sizes) > NAMES:
                self.sizes.popitem(last=False)

    def known_size(self, node: Node, trunc: bool, append: bool = False) -> int | None:
        """What a writer of ``node`` is expected to write: the size of its name's last
        version, or of the file itself when it is reopened without ``O_TRUNC``; None when
        neither is known, and for an appender (a log grows by what it appends, whatever it
        held before)."""
        if append:
            return None
        seen = self.sizes.get(node.name) or None    # an empty version predicts nothing
        if not trunc and node.size:
            return max(node.size, seen or 0)
        return seen

    def admit(self, node: Node, trunc: bool, append: bool = False) -> bool:
        """Whether a writer of ``node`` opening now may be passed through (module doc)."""
        size = self.known_size(node, trunc, append)
        if size is None and not self.files.store.in_ram:
            size = PASS_WRITER_RESERVE
        # kept content may be written past its end (dd conv=notrunc, r+): such a writer is
        # passed through only with PASS_WRITER_RESERVE free beyond it, though it reserves
        # (``owed``) only its size, so that a small file reopened starves nobody
        room = PASS_WRITER_RESERVE if not trunc and node.size and size is not None else 0
        outcome = self._decide(node, size, room)
        self.counts[outcome] += 1
        if outcome == PASSED:
            self.reserved[node.ino] = size
        return outcome == PASSED

    def _decide(self, node: Node, size: int | None, room: int = 0) -> str:
        files, store = self.files, self.files.store
        with files.oplog.lock:
            if store.used > store.limit:
                return "over_size"
            if size is None:
                return "unknown_size"
            open_now = {w.ino for w in files.passthrough_writers}
            for ino in [i for i in self.reserved if i not in open_now]:
                del self.reserved[ino]
            self._said &= open_now
            want = self._wanted(node, size)
            files.lru.pop(node.ino, None)    # not room for itself (Files.open takes a
            if not files.has_room(max(want, room), node):   # writer's file out of the LRU anyway)
                return "no_room"
            files.reserve(want, node)   # evicted now, not at the next trim: the bound holds at once
            return PASSED

    def owed(self, skip: Node | None = None) -> int:
        """Bytes of the free space promised to writers passed through (but ``skip``) and not
        yet written by them: ``Files.reserve`` leaves them to their writers (``Files.owed``)."""
        return sum(self._still_wanted(w) for w in self.files.passthrough_writers if w is not skip)

    def _wanted(self, node: Node, size: int) -> int:
        held = self.files.store.nbytes(node.content) if node.content is not None else 0
        return max(0, max(size, node.size) - held)

    def _still_wanted(self, node: Node) -> int:
        return self._wanted(node, self.reserved.get(node.ino, 0))

    def check_growth(self) -> None:
        """Learn the size of each writer passed through that wrote more than GROWTH past its
        reservation (after ``Files.sync_content``), and on a store in RAM say so, once, in
        the log."""
        for node in self.files.passthrough_writers:
            reserved = self.reserved.get(node.ino)
            if reserved is None or node.ino in self._said or node.size <= reserved + GROWTH:
                continue
            self._said.add(node.ino)
            self.learn(node)
            if not self.files.store.in_ram:
                continue   # a guess on a disk store (the page cache bounds its RAM)
            log.warning("%s: written with passthrough to %s, %s past the size its name had "
                        "when it was admitted; the cache holds that much more than its size "
                        "allows until the file is closed and persisted, and the next writer "
                        "of that name reserves its new size", node_path(node),
                        format_size(node.size), format_size(node.size - reserved))

    def status(self) -> dict[str, int]:
        """Writers' opens that could have been passed through, by what was decided."""
        return dict(self.counts)
