"""Meeting the other writers of the backing: what the flusher does when the backing does
not hold what this node left there (docs/semantics.md, conflicts; docs/design.md).

Owns ``conflicts`` (conflicts.py: every conflict met, for status and the log) and the ways
around them, each called by the flusher with ``Inodes.position_lock`` held: making way for an
op's entry (``make_way``: adopt, move aside or replace what stands at its name), removing
only what this node knows (``remove``), noting a copy gone (``gone``), and making again a
directory removed behind acpfs's back (``restore_dirs``). Nothing here waits or retries:
the flusher retries the op around it.
"""

from __future__ import annotations

import os
import stat as statmod

from ..backing.backing import Backing, Comps, MissingDir, NotEmpty, flat_name
from ..cache.cache import Cache
from .conflicts import Conflicts, describe_entry
from ..oplog.ops import Mknod, Op, Publish, Rename, Symlink
from ..node import Node


def version_of(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of a file in the backing from another."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def kind_of(node: Node) -> str:
    return "directory" if node.is_dir else "symlink" if node.is_link else \
        "file" if node.is_reg else "special file"


class Repairs:
    def __init__(self, cache: Cache, backing: Backing) -> None:
        self.cache = cache
        self.backing = backing
        self.conflicts = Conflicts(backing.instance)

    def gone(self, node: Node, path: str) -> None:
        """The node's copy is gone from the backing, removed by something other than this
        mount (hold position_lock). A directory is made again in its place (ops into it
        follow); a file counts as absent there, and its next snapshot lands again."""
        self.conflicts.note("gone", path, f"changes the attributes of this {kind_of(node)}", "nothing",
                            "the directory is made again" if node.is_dir
                            else "changed under another of its names" if node.backing_links
                            else "its next snapshot lands again")
        parent = node.backing_parent
        assert parent is not None   # the caller changed it there
        if node.is_dir:
            self.backing.mkdir(self.cache.inodes.backing_path(parent), node.backing_name,
                               node.mode, node.uid, node.gid)
        else:   # that name only: a file with others is changed there (the caller goes on)
            node.move_position((parent, node.backing_name), None)

    def restore_dirs(self, where: Node, exc: BaseException) -> None:
        """A directory the mount has, and the flusher put in the backing, is missing there
        (MissingDir): removed or moved behind acpfs's back. Changes made through the mount
        still go into it, so it is made again, from the mount's view (mode, owner), with
        every directory below it on the way to ``where``. What else it held in the backing
        went with it; the mount is the truth for what it acknowledged."""
        if not isinstance(exc, MissingDir):
            return
        cache = self.cache
        with cache.inodes.position_lock:
            chain: list[Node] = []
            n: Node | None = where
            while n is not cache.inodes.root:
                if n is None:
                    return   # not in the backing yet: an earlier op makes it
                chain.append(n)
                n = n.backing_parent
            chain.reverse()
            comps = [c.backing_name for c in chain]
            if comps[:exc.depth + 1] != exc.comps[:exc.depth + 1]:
                return       # moved meanwhile: the next attempt sees afresh
            for i in range(exc.depth, len(chain)):
                d = chain[i]
                path = os.fsdecode(b"/".join(comps[:i + 1]))
                if i == exc.depth and exc.blocked:   # another kind of entry stands there
                    self.make_way_for_dir(path, comps[:i], comps[i])
                if not self.backing.mkdir(comps[:i], comps[i], d.mode, d.uid, d.gid):
                    continue   # another upload into it made it again first: one conflict
                self.conflicts.note("dir_recreated", path, "writes into this directory",
                                    "nothing there (removed or moved by another writer)",
                                    "made again from this node's view")

    def make_way(self, op: Op, comps: Comps, name: bytes, known: Node | None,
                  seen: tuple[int, int, int] | None = None) -> None:
        """Before ``op`` puts its node's entry at ``comps``/``name`` (hold position_lock):
        resolve what another writer left there. ``known`` is the node whose backing copy
        this node expects at the name (the one it replaces), or None; ``seen`` a version
        of a file this node expects there."""
        node = op.node
        st = self.backing.stat_entry(comps, name)
        if st is None:
            return
        path = op.path
        theirs_dir = statmod.S_ISDIR(st.st_mode)
        if node.is_dir and theirs_dir:
            # mkdir adopts a directory that is there (ranks make the same one); a directory
            # renamed over another replaces it only if it is empty, as rename(2) does, in
            # the same step (removed first, the backing would show a state without either)
            if isinstance(op, Rename) and not self.backing.empty_dir(comps, name):
                self.move_aside(op.path, comps, name, st, f"renames a directory to {path!r}")
            return
        if node.is_dir or theirs_dir:
            self.move_aside(path, comps, name, st, f"puts a {kind_of(node)} at {path!r}")
            return
        # a file or symlink over a file or symlink: the last publisher wins, whole files only
        if (known is not None and known.backing_version in (None, version_of(st))) \
                or (seen is not None and seen == version_of(st)):
            return        # its own copy, or one it saw
        if node.is_link and statmod.S_ISLNK(st.st_mode) and isinstance(op, Symlink):
            if self.backing.read_link(comps, name) == node.target:
                return    # the same symlink, made by another node too
        ours = f"{'publishes' if isinstance(op, Publish) else 'puts'} a {kind_of(node)}"
        if isinstance(op, Publish):
            ours += f" of {op.nbytes} bytes"
        self.conflicts.note("replaced", path, ours, f"{describe_entry(st)} it never saw",
                            "the last publisher wins: this node's replaces it")
        if isinstance(op, (Symlink, Mknod)):
            self.backing.unlink(comps, name, False)    # symlink(2) and mknod(2) do not replace

    def make_way_for_dir(self, path: str, comps: Comps, name: bytes) -> None:
        st = self.backing.stat_entry(comps, name)
        if st is not None and not statmod.S_ISDIR(st.st_mode):
            self.move_aside(path, comps, name, st, "writes into a directory of this name")

    def move_aside(self, path: str, comps: Comps, name: bytes, st: os.stat_result, ours: str) -> None:
        aside = self.backing.move_aside(comps, name, self.conflicts.aside_stamp,
                                        flat_name(os.fsdecode(b"/".join(comps + [name]))))
        self.conflicts.note("moved_aside", path, ours, describe_entry(st),
                            f"it was moved to {aside!r}")

    def remove(self, path: str, comps: Comps, name: bytes, node: Node) -> None:
        """Remove ``node``'s backing copy at ``comps``/``name`` (hold position_lock), unless
        another writer changed that name meanwhile: what this node never saw is kept."""
        st = self.backing.stat_entry(comps, name)
        what = f"removes this {kind_of(node)}"
        if st is None:
            self.conflicts.note("gone", path, what, "nothing (removed by another writer)",
                                "nothing to remove")
            return
        if statmod.S_IFMT(st.st_mode) != statmod.S_IFMT(node.mode) \
                or (node.is_reg and node.backing_version is not None
                    and version_of(st) != node.backing_version) \
                or (node.is_link and self.backing.read_link(comps, name) != node.target):
            self.conflicts.note("kept", path, what, f"{describe_entry(st)} it never saw",
                                "left in place: newer than what this node removed")
            return
        try:
            self.backing.unlink(comps, name, node.is_dir)
        except NotEmpty as e:
            names = ", ".join(repr(os.fsdecode(n)) for n in e.entries[:5])
            more = f" and {len(e.entries) - 5} more" if len(e.entries) > 5 else ""
            self.conflicts.note("not_empty", path, what,
                                f"{len(e.entries)} entries it never had in it: {names}{more}",
                                "the directory stays, holding them")
