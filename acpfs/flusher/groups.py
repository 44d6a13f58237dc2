"""Publishes renamed into one directory that share its fsync (a group commit).

A publish is durable once its rename is: today's protocol fsyncs the directory after every
rename, which made the sequencer pay a journal commit per file (on ext4 about half of its
time per small file, docs/benchmarks.md, "Files persisted per second"). When the next ops in
the queue are publishes into the same directory whose uploads are done, the sequencer
renames them one after the other and fsyncs the directory once (``Flusher._commit``); only
then do they count as applied (``OpLog.pop``, ``applied``), so ``acpfs sync`` and the
journal see each of them only once it is durable, as before.

Why the strict prefix holds (docs/semantics.md, section 4): the renames are made in queue
order, in one directory, each after its file's own fsync (``write_temp``); a crash before the
directory's fsync keeps a prefix of them where the filesystem makes metadata durable in the
order it was made (ext4 and XFS journals, btrfs's log; NFS and Lustre servers commit each
rename before they answer), and the journal replays the rest. A group never spans two
directories, an op of another kind, nor a file staged elsewhere or with several names
(``Flusher._joins``).

Owns ``Group``: the applied ops waiting for the fsync, in order, and the descriptors of the
directories to fsync (normally one: a second appears only when the directory was replaced
under its path between two renames). Threads: the sequencer's only.
"""

from __future__ import annotations

import os
from typing import Callable

from ..oplog.ops import Op

GROUP_MAX = 256   # ops that wait for one fsync at most: the wait of the first stays short


class Group:
    def __init__(self) -> None:
        self.ops: list[Op] = []              # applied to the backing, not popped yet
        self.fds: dict[tuple[int, int], int] = {}   # (st_dev, st_ino) -> fd, to fsync
        self.commits = 0                     # fsyncs that landed a group
        self.grouped = 0                     # ops that landed in a group of two or more

    def keep(self, fd: int) -> None:
        """A directory a publish renamed into without its fsync: fsynced at the commit
        (the descriptor is the group's now)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key in self.fds:
            os.close(fd)
        else:
            self.fds[key] = fd

    def sync(self, fsync: Callable[[int], None], close: Callable[[int], None]) -> None:
        """fsync each directory of the group, forgetting each once it is done (a retry goes
        on with the rest); counted once all are."""
        while self.fds:
            fsync(next(iter(self.fds.values())))
            self.forget_first(close)
        self.commits += 1

    def forget_first(self, close: Callable[[int], None]) -> None:
        """The first directory needs no fsync (done, or gone stale): its descriptor closed."""
        key = next(iter(self.fds))
        close(self.fds.pop(key))

    def full(self) -> bool:
        return len(self.ops) >= GROUP_MAX

    def committed(self) -> list[Op]:
        """The ops of a group now durable (the descriptors closed); the group starts anew."""
        ops, self.ops = self.ops, []
        if len(ops) > 1:
            self.grouped += len(ops)
        return ops
