"""Conflicts: what the flusher finds in the shared backing that this node did not put there.

Many nodes mount acpfs over one shared directory, and other programs change it too. When the
flusher applies an op and the backing no longer holds what this node last knew of it, the op
is resolved by one fixed rule per case (docs/semantics.md, section 10, "Conflicts"), never
retried for ever, and never by dropping data this node or another acknowledged:

=====================  ========================================================================
kind                   case, and the rule
=====================  ========================================================================
``replaced``           a file or symlink lands on a name holding a version this node never
                       saw (another node published it meanwhile): the last publisher wins,
                       whole files only.
``kept``               an unlink finds at the name a version, or a kind of entry, this node
                       never saw: it is left in place (it is newer than what was unlinked).
``not_empty``          an rmdir finds entries this node never had in the directory (another
                       node's files that landed after this node listed it): the directory
                       stays, holding them.
``gone``               an unlink, rename or attribute change finds its entry already removed
                       by another writer: nothing to remove; a file lands again at its next
                       snapshot, a directory is made again.
``dir_recreated``      a directory this node still writes into was removed or moved by another
                       writer: it is made again, from this node's view, and the writes land.
``refused``            the backing refuses a special file with ``EPERM`` (device nodes on an NFS
                       export with ``root_squash``): no retry can make it, so it stays in this
                       mount only and the queue moves on.
``moved_aside``        an entry of another kind (a directory where this node puts a file, a
                       file where it makes a directory, a non-empty directory a directory is
                       renamed over) stands in the way: it is moved to
                       ``.acpfs-conflicts/<time>-<instance>/`` and this node's entry takes
                       the name.
=====================  ========================================================================

Each conflict is logged at WARNING with both sides (this node's op, the entry found in the
backing) and counted in ``status`` (section ``conflicts``). The counters live as long as the
daemon.
"""

from __future__ import annotations

import collections
import logging
import os
import stat as statmod
import threading
import time

log = logging.getLogger(__name__)

KINDS = ("replaced", "kept", "not_empty", "gone", "dir_recreated", "moved_aside", "refused",
         "split")
RECENT = 20     # conflicts kept in full for ``status``


def describe_entry(st: os.stat_result | None) -> str:
    """One backing entry as the log and ``status`` name it."""
    if st is None:
        return "nothing"
    kind = ("directory" if statmod.S_ISDIR(st.st_mode) else "symlink" if statmod.S_ISLNK(st.st_mode)
            else "file")
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))
    size = f"{st.st_size} bytes, " if kind == "file" else ""
    return f"a {kind} ({size}inode {st.st_ino}, uid {st.st_uid}, modified {when})"


class Conflicts:
    """The conflicts of one daemon: counted by kind, the last ``RECENT`` kept whole."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        # where entries moved out of the way go: one folder per daemon
        self.aside_stamp = (time.strftime("%Y%m%dT%H%M%S") + "-" + instance).encode()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT)

    def note(self, kind: str, path: str, ours: str, theirs: str, resolution: str) -> None:
        """Record one conflict: this node's op ``ours`` on ``path`` met ``theirs`` in the
        backing, and was resolved by ``resolution``."""
        assert kind in KINDS, kind
        log.warning("conflict at %r (%s): this node %s; the backing held %s; %s",
                    path, kind, ours, theirs, resolution)
        with self._lock:
            self.counts[kind] += 1
            self.recent.append({"at": round(time.time(), 3), "kind": kind, "path": path,
                                "ours": ours, "theirs": theirs, "resolution": resolution})

    def status(self) -> dict:
        with self._lock:
            return {"total": sum(self.counts.values()),
                    "by_kind": {k: self.counts[k] for k in KINDS},
                    "recent": list(self.recent)}
