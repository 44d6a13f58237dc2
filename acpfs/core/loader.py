"""Loading and revalidation: what requests learn from the backing, in worker threads.

Owns the checks of the backing that requests make under trio: a directory's entries
loaded once (``loaded``) and listed again at an opendir (``refreshed``), extended
attributes loaded once (``xattrs_loaded``), a name the view lacks looked up
(``found_elsewhere``), a clean file or another entry compared with its backing copy
(``revalidated``, ``entry_checked``). It owns the locks that let one listing of a
directory run at a time (``_list_locks``), the keys with a check in flight
(``_checking``: at most one per inode or name) and the threads those checks may take
(``check_threads``), so that checks stuck on a hung backing never take the threads cached
work needs. A check waits at most COHERENCE_WAIT seconds; then the request answers from
what the mount knows. What an answer changes in the view is ``coherence.Coherence``'s.

Runs on the trio thread; every backing call is made in a worker thread, under
``Inodes.position_lock`` (``Coherence``'s listing and stat calls, ``xattrs_loaded``).
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import stat as statmod
import time
from typing import Callable, NoReturn, TypeVar

import trio

from ..backing.backing import Backing, is_internal_name
from ..cache.coherence import Coherence, Relisting
from ..config import Options
from ..cache.inodes import Inodes
from ..node import KernelNotices, Node, err, name_path, node_path
from .backcalls import BackingCalls

T = TypeVar("T")
log = logging.getLogger(__name__)

# seconds a lookup, listing, open or stat waits for the backing to say what other nodes changed
# before it answers from what this mount knows (a hung backing must not block cached work)
COHERENCE_WAIT = 0.5
# a directory of at most this many entries is listed again where BackingCalls says (on the
# event loop for a local backing: an lstat per entry, ~0.1 ms for 64), a larger one always
# in a worker thread
QUICK_LISTING = 64
# a directory not yet loaded whose size in the backing is at most this is listed where
# BackingCalls says too: a few hundred entries at most on any filesystem (ext4 and xfs count
# bytes of entries, tmpfs 20 per entry, btrfs twice the names' bytes), listed in under a ms
QUICK_DIR_BYTES = 8192


class Loader:
    def __init__(self, inodes: Inodes, coherence: Coherence, backing: Backing,
                 opts: Options, kernel_notices: KernelNotices,
                 invalidate_attrs: Callable[[int], None]) -> None:
        self.inodes = inodes
        self.coherence = coherence
        self.backing = backing
        self.opts = opts   # coherence_timeout
        self.kernel_notices = kernel_notices   # forgets a name to be looked at again
        # the kernel forgets an inode's attributes before this returns (only ever called for
        # the inode of the request being answered: the kernel holds it, never evicting it)
        self.invalidate_attrs = invalidate_attrs
        self._list_locks: dict[int, trio.Lock] = {}
        self._checking: set[object] = set()   # inos and names with a check in a worker thread
        self.check_threads = trio.CapacityLimiter(8)   # checks stuck on a hung backing stop here
        local = backing.local_fstype if opts.backing_calls == "auto" else None
        self.calls = BackingCalls(local, inodes.position_lock)   # on the event loop or in a thread

    async def loaded(self, node: Node) -> Node:
        """Make sure a directory's entries are known (read from the backing once)."""
        if node.children is None:
            if not node.is_dir:
                raise err(errno.ENOTDIR)
            lk = self._list_locks.get(node.ino)
            if lk is None:
                lk = self._list_locks[node.ino] = trio.Lock()
            async with lk:
                if node.children is None:
                    run = self.calls.run if node.size <= QUICK_DIR_BYTES else trio.to_thread.run_sync
                    listing = await run(self.coherence.list_backing, node)
                    self.coherence.attach_listing(node, listing)
            self._list_locks.pop(node.ino, None)
        return node

    def loaded_now(self, node: Node) -> bool:
        """``loaded`` where it needs no coroutine (a request answered at once in a directory
        not listed yet: the first file looked up in a directory another node wrote): True
        once the entries are known, a small directory listed on the event loop
        (``BackingCalls.try_now``); False where a listing is under way, the directory is
        large or not one, the call would take a worker thread, or the backing failed
        (``loaded`` then does what that asks)."""
        if node.children is not None:
            return True
        if not node.is_dir or node.ino in self._list_locks or node.size > QUICK_DIR_BYTES:
            return False
        try:
            ran, listing = self.calls.try_now(self.coherence.list_backing, node)
        except OSError:
            return False
        if not ran:
            return False
        self.coherence.attach_listing(node, listing)  # type: ignore[arg-type]
        return True

    async def xattrs_loaded(self, node: Node) -> dict[bytes, bytes]:
        if node.xattrs is None:
            inodes, backing = self.inodes, self.backing

            def read() -> dict[bytes, bytes]:
                with inodes.position_lock:
                    if node is inodes.root:
                        return backing.read_xattrs([], None)
                    if node.backing_parent is None or node.is_link:
                        return {}
                    return backing.read_xattrs(inodes.backing_path(node.backing_parent),
                                               node.backing_name)
            values = await trio.to_thread.run_sync(read)
            if node.xattrs is None:
                node.xattrs = values
        return node.xattrs

    async def refreshed(self, node: Node) -> Node:
        """At an opendir: a loaded directory whose backing entries were merged in at most
        ``coherence_timeout`` seconds ago, and listed afresh at once when the backing
        directory's version changed since the last listing (one stat of it), as NFS
        revalidates a directory it opens: other nodes' changes show (close-to-open). Only
        directories this mount has put in the backing are looked at again; one listing at a
        time per directory. (A lookup looks at its one name instead: ``Core._lookup``.)"""
        coherence = self.coherence
        timeout = self.opts.coherence_timeout
        if not self.inodes.present(node) or node.children is None or node.ino in self._checking:
            return node
        lk = self._list_locks.get(node.ino)
        if lk is None:
            lk = self._list_locks[node.ino] = trio.Lock()
        async with lk:
            stale = time.monotonic() - node.listed_at > timeout
            if self.inodes.present(node) and node.ino not in self._checking:
                relist = functools.partial(coherence.relist_backing, node,
                                           unless=None if stale else node.listed_version)
                got: Relisting | None | bool = False
                small = node.children is not None and len(node.children) <= QUICK_LISTING
                try:
                    with trio.move_on_after(COHERENCE_WAIT):
                        got = await self._check(node.ino, relist, quick=small)
                except OSError as e:   # a failing backing: what this mount knows stands
                    log.debug("relisting %s: %s", node_path(node), e)
                if got is False:       # failing or not answering: look again after the timeout
                    if stale:
                        node.listed_at = time.monotonic()
                elif got is None:      # unchanged since the last listing
                    node.listed_at = time.monotonic()
                elif node.children is not None and (node.parent is not None or node is self.inodes.root):
                    coherence.merge_listing(node, *got)
        self._list_locks.pop(node.ino, None)
        return node

    async def found_elsewhere(self, parent: Node, name: bytes) -> Node | None:
        """A name this mount's view of ``parent`` lacks: looked up in the backing (one lstat,
        as NFS looks up a name it has no entry for), so that a file another node made is
        seen at once, not at the next listing. None when it is missing, known for sure:
        not in the backing, or this mount has a change of its own pending on the name (its
        removal wins in its own view) or on the directory (not in the backing yet), or an
        internal name; ENOENT (raised) when that is
        not known: the backing failed or did not answer in time, or a check of the name is
        in flight already."""
        coherence = self.coherence
        key = (parent.ino, name)
        if is_internal_name(name):
            return None
        if not self.inodes.present(parent):
            # not in the backing yet (this mount's mkdir of it is pending) or gone from it:
            # nothing there can hold the name, and this mount's view wins until it lands
            return None
        if key in self._checking:
            raise err(errno.ENOENT)
        got: tuple | None | bool = False   # False: no answer
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(key, functools.partial(coherence.stat_name, parent, name))
        except OSError as e:
            log.debug("looking up %s in the backing: %s", name_path(parent, name), e)
        node = parent.children.get(name) if parent.children is not None else None
        if node is None and got and parent.children is not None:
            node = coherence.attach_found(parent, name, got)
        if node is None and (got is False or parent.children is None):
            raise err(errno.ENOENT)
        return node

    def found_elsewhere_now(self, parent: Node, name: bytes) -> tuple[bool, Node | None]:
        """``found_elsewhere`` where it can be told at once (a LOOKUP answered without a
        coroutine, ``Core.find_now``): (True, the node or None) as ``found_elsewhere`` returns,
        its lstat on the event loop (``BackingCalls.try_now``); (False, None) where that
        cannot be done at once (a worker thread would take the call, a check of the name is
        under way, the backing failed: ``found_elsewhere`` then does what that asks)."""
        if is_internal_name(name) or not self.inodes.present(parent):
            return True, None
        if (parent.ino, name) in self._checking or parent.children is None:
            return False, None
        try:
            ran, got = self.calls.try_now(self.coherence.stat_name, parent, name)
        except OSError:
            return False, None
        if not ran:
            return False, None
        node = parent.children.get(name)
        if node is None and got:
            node = self.coherence.attach_found(parent, name, got)
        return True, node

    def answer_holds_for(self, node: Node) -> float:
        """For how many seconds a GETATTR answer of ``node`` given now stays the one this
        mount would give, unless a request or another node changes it (which remove it:
        fuse/attrtable.py), or the kernel writes it (a writer passed through: its size and
        times are its memory file's, ``Files.sync_content``): 0 for a file being compared
        with the backing; for a clean file in the backing, until its next comparison is due
        (``revalidated``)."""
        if node.ino in self._checking:
            return 0.0
        if not node.is_reg or node.backing_parent is None or not self.coherence.quiescent(node):
            return math.inf
        return node.checked_at + self.opts.coherence_timeout - time.monotonic()

    async def revalidated(self, node: Node, at_open: bool = False, forget: bool = True) -> Node:
        """A clean file whose backing copy was compared with this mount's at most
        ``coherence_timeout`` seconds ago (inode, size, mtime): a version another node
        published since replaces a stale cached copy and its attributes (close-to-open).

        ``at_open``: compared now, whenever it was last (close-to-open at every open, as
        NFS's GETATTR at open), and the kernel forgets the old attributes before the open is
        answered. A name whose backing entry is gone or another kind of entry, or another
        version of a file open here (its readers keep theirs), leaves this node: the open
        fails with ESTALE, on which the kernel looks the name up again and opens what the
        backing holds now (the old node lives on for the descriptors open on it)."""
        coherence = self.coherence
        if not node.is_reg or node.backing_parent is None \
                or (not at_open and time.monotonic() - node.checked_at <= self.opts.coherence_timeout) \
                or node.ino in self._checking or not coherence.quiescent(node):
            return node
        got = None
        node.checked_at = time.monotonic()   # failing or not answering: look again later
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(node.ino, functools.partial(coherence.stat_backing, node))
        except OSError as e:
            log.debug("revalidating %s: %s", node_path(node), e)
            return node
        stats, applied = got if got is not None else ([], 0)
        if not stats or not coherence.quiescent(node, applied) or node.backing_version is None:
            return node
        pos, st = stats[0]
        lost_name = False
        if at_open and not node.links and (node.parent, node.name) == pos \
                and (node.backing_parent, node.backing_name) == pos \
                and (st is None or not statmod.S_ISREG(st.st_mode)
                     or (node.opens and (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version)):
            await self._leaves_view(pos[0], pos[1], node, gone=st is None)
        if st is not None and statmod.S_ISREG(st.st_mode) \
                and (node.backing_parent, node.backing_name) == pos \
                and (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version:
            if not node.links or st.st_nlink >= len(node.names()):
                # a new version (another node republishes a linked file under every name)
                coherence.replaced_elsewhere(node, st)
                if at_open and forget and node.opens == 0:
                    self.invalidate_attrs(node.ino)   # before the reader's first read
            else:
                # another file under this name alone: split off now at an open or lookup
                # (then ESTALE below), else at the next lookup of the name (the kernel
                # forgets it); never read or written as this file
                self._another_file_at(pos, node, st, at_open)
                lost_name = True
        # a file with several names: each of them, as close-to-open asks. A name another
        # node removed leaves the file (which keeps its others); one that holds another
        # file is split off. At an open, either answers ESTALE below
        for pos, st in stats if node.links else ():
            if node.position_at(*pos) is None or pos[0].children is None \
                    or pos[0].children.get(pos[1]) is not node or not node.links:
                continue
            if st is None:
                coherence.removed_elsewhere(pos[0], pos[1], node)
                lost_name = True
            elif (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version:
                self._another_file_at(pos, node, st, at_open)
                lost_name = True
        if at_open and lost_name:
            # the open may have come through the name that left: the kernel looks the
            # path up again, and opens the file, a new one, or nothing, as the backing has it
            raise err(errno.ESTALE, "another writer removed or replaced a name of the file")
        return node

    def unchanged_now(self, node: Node) -> bool:
        """Whether the close-to-open check of an open (``revalidated(at_open=True)``) leaves
        ``node``, a regular file with one name, as it is, told at once on the event loop
        (``BackingCalls.run_now``): True where there is nothing to compare (this mount's
        own version, not persisted yet) or the backing copy is the version this mount has;
        False where it is another, where the backing fails, or where that cannot be told at
        once (``revalidated`` then looks, and does what a change or a failure asks)."""
        coherence = self.coherence
        if node.links or node.ino in self._checking:
            return False
        if node.backing_parent is None or not coherence.quiescent(node):
            return True
        try:
            got = self.calls.run_now(coherence.stat_backing, node)
        except OSError:   # ``revalidated`` says what a failing backing means for the open
            return False
        if got is None or len(got[0]) != 1 or node.backing_version is None \
                or not coherence.quiescent(node, got[1]):
            return False
        pos, st = got[0][0]
        if pos != (node.backing_parent, node.backing_name) or pos != (node.parent, node.name) \
                or st is None or not statmod.S_ISREG(st.st_mode) \
                or (st.st_ino, st.st_size, st.st_mtime_ns) != node.backing_version:
            return False
        node.checked_at = time.monotonic()
        return True

    def _another_file_at(self, pos: tuple[Node, bytes], node: Node, st: os.stat_result,
                         at_open: bool) -> None:
        """A name of a file with several names holds another file in the backing now (another
        writer replaced that name alone): at an open or lookup it becomes that file in the
        view at once (``Coherence.split``), and an entry of another kind there (a directory,
        a symlink) takes the name from the file, which keeps its others (the lookup then
        finds what the backing holds: ``Core._lookup``); otherwise at the next lookup of
        the name."""
        if at_open and node.links and statmod.S_ISREG(st.st_mode):
            self.coherence.split(pos[0], pos[1], node, st)
        elif at_open and node.links:
            self.coherence.removed_elsewhere(pos[0], pos[1], node)
        else:
            self._look_again(pos)

    async def entry_checked(self, parent: Node, name: bytes, node: Node) -> None:
        """A directory, symlink or special file known under ``parent``/``name``, compared with
        the backing at a lookup: gone there, or another kind of entry there (another writer
        removed it, with all below it, or put something else in its place), it leaves the
        view (ESTALE; the name then holds what the backing has), unless this mount has a
        change of its own pending on it or below it."""
        if not self._entry_to_check(parent, name, node):
            return
        got = None
        try:
            with trio.move_on_after(COHERENCE_WAIT):
                got = await self._check(node.ino, functools.partial(self.coherence.stat_backing, node))
        except OSError as e:
            log.debug("looking at %s: %s", node_path(node), e)
        gone = self._entry_verdict(parent, name, node, got)
        if gone is not None:
            await self._leaves_view(parent, name, node, gone=gone)

    def entry_unchanged_now(self, parent: Node, name: bytes, node: Node) -> bool:
        """Whether ``entry_checked`` would leave ``node`` as it is, told at once on the event
        loop (``BackingCalls.try_now``; a LOOKUP answered at once, ``Core.find_now``): False
        where the call would take a worker thread, the backing fails, or the backing holds
        another kind of entry there or none (``entry_checked`` then does what that asks)."""
        if not self._entry_to_check(parent, name, node):
            return True
        try:
            ran, got = self.calls.try_now(self.coherence.stat_backing, node)
        except OSError:
            return False
        return ran and self._entry_verdict(parent, name, node, got) is None

    def _entry_to_check(self, parent: Node, name: bytes, node: Node) -> bool:
        """``node`` is where ``parent``/``name`` says, in the view and in the backing, and no
        check of it runs: ``entry_checked`` compares it."""
        return node.ino not in self._checking and node.backing_parent is parent \
            and node.backing_name == name and node.parent is parent and node.name == name

    def _entry_verdict(self, parent: Node, name: bytes, node: Node, got) -> bool | None:
        """What ``Coherence.stat_backing``'s answer ``got`` (None: no answer) asks of the entry
        ``node`` at a lookup: None, it stays (the answer is for another position now, this
        mount changed it or below it since, or the backing holds the same kind of entry);
        True, it is gone from the backing; False, another kind of entry holds its name."""
        if got is None or not got[0]:
            return None
        (pos, st), applied = got[0][0], got[1]
        if pos != (parent, name) or parent.children is None or parent.children.get(name) is not node \
                or not self.coherence.subtree_quiescent(node, applied):
            return None
        if st is None:
            return True
        return None if statmod.S_IFMT(st.st_mode) == statmod.S_IFMT(node.mode) else False

    async def _leaves_view(self, parent: Node, name: bytes, node: Node, gone: bool) -> NoReturn:
        """Another writer removed ``node``'s entry from the backing, or put another entry
        under its name: the node leaves the view (it lives on for descriptors open on it),
        the name holds what the backing has now (looked up as a missing name is), and the
        request answers ESTALE, on which the kernel looks the name up again."""
        self.coherence.removed_elsewhere(parent, name, node)
        if not gone:
            try:
                await self.found_elsewhere(parent, name)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
        raise err(errno.ESTALE, "another writer removed or replaced the entry in the backing")

    def _look_again(self, pos: tuple[Node, bytes]) -> None:
        """The kernel forgets the name, so that its next lookup compares it with the backing
        as at an open (``Core._lookup``: a name holding another file is split off there), and
        the next opendir lists the directory afresh."""
        pos[0].listed_at = pos[0].read_at = 0.0
        self.kernel_notices.forget_entry(pos[0].ino, pos[1])

    async def _check(self, key: object, fn: Callable[[], T], quick: bool = True) -> T:
        """``fn()`` in a worker thread that may be abandoned (a hung backing): at most one
        per ``key`` (an inode, a name) at a time, and at most ``check_threads`` in all, so
        that stuck checks never take the threads that cached work needs. ``quick`` (a stat,
        not a listing): on the event loop where ``BackingCalls`` says it may."""
        self._checking.add(key)
        started = []

        def job():
            started.append(True)
            try:
                return fn()
            finally:
                self._checking.discard(key)
        try:
            if quick:
                return await self.calls.run(job, abandon_on_cancel=True, limiter=self.check_threads)
            return await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self.check_threads)
        finally:
            if not started:      # cancelled while waiting for a thread: it never ran
                self._checking.discard(key)

