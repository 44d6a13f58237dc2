"""The types every part of the core shares: nodes, staged files, snapshots, and
the enums that name op kinds, op states and journal states.

Nothing here does I/O or imports another acpfs module, so ``cache``, ``flusher``,
``writethrough``, ``journal`` and ``recovery`` can all depend on it without a circle.
Which thread may touch which field, and under which lock, is in docs/concurrency.md; the
short form is next to each field.

Vocabulary (one name per concept):
    cached        a file whose content is in the content store (``Node.content``)
    written through / staged
                  a file too large for the cache (or open for a long time) whose content
                  lives in a *staged file* in the backing (``Node.staged``, ``Staged``)
                  instead; its last close hands the staged file to a publish op
    snapshot      an immutable picture of a file at its last close: what one upload writes
    position      where a node currently is in the backing (``backing_parent``/``backing_name``),
                  which lags behind its place in the mount until the flusher catches up
    name          a (directory, name) pair naming a node in the mount; a file with hard links
                  has several (``Node.parent``/``name`` first, ``Node.links`` the others),
                  and as many positions in the backing (``backing_links``), all one inode there
"""

from __future__ import annotations

import enum
import os
import stat as statmod
import time
from typing import Any, Callable, Protocol


ROOT_INODE = 1   # the mount's root directory, the kernel's FUSE_ROOT_ID


def now_ns() -> int:
    return time.time_ns()


class OpKind(str, enum.Enum):
    """What an op (``oplog.ops.Op``) does to the backing. The values are what the journal stores."""
    PUBLISH = "publish"    # a file's snapshot: upload to a temporary name, rename into place
    LINK = "link"          # one more name for a node (a hard link)
    MKDIR = "mkdir"
    SYMLINK = "symlink"
    MKNOD = "mknod"        # a FIFO, socket or device node
    UNLINK = "unlink"
    RMDIR = "rmdir"
    RENAME = "rename"
    SETATTR = "setattr"    # mode, owner, times of a file not being published anyway
    XATTR = "xattr"        # one user extended attribute set or removed

    def __str__(self) -> str:
        return self.value


class OpState(enum.Enum):
    """queued -> uploading -> finalizing -> done; queued/uploading -> void when the op right
    after it removes its file before it was persisted (``Files.cancel``)."""
    QUEUED = "queued"
    UPLOADING = "uploading"
    FINALIZING = "finalizing"
    DONE = "done"
    VOID = "void"

    def __str__(self) -> str:
        return self.value


class QueuedPublish(Protocol):
    """What a node sees of a publish op queued for it (``oplog.ops.Publish``, which the op log
    owns; a protocol, so that this module imports no other acpfs module)."""
    seq: int
    state: OpState
    error: str | None


class JournalState(enum.IntEnum):
    """What the journal last said about a file (``Node.journal_state``); recovery acts on
    the last record of each file."""
    NONE = 0      # nothing pending: a later crash leaves the backing version alone
    DIRTY = 1     # open with unsaved changes; at a crash they are dropped (logged)
    FLUSHED = 2   # its last writer closed it; at a crash this content is published


class Children(dict):
    """A loaded directory's entries, name -> Node, counting the directories among them
    (``dirs``: a directory's link count is 2 plus that, asked for at every GETATTR of it).
    Invariant: ``dirs`` is the number of values that are directories; entries change only
    by ``d[name] = node`` and ``del d[name]`` (a node's kind never changes)."""
    __slots__ = ("dirs",)

    def __init__(self) -> None:
        super().__init__()
        self.dirs = 0

    def __setitem__(self, name: bytes, node: "Node") -> None:
        old = self.get(name)
        if old is not None:
            self.dirs -= old.is_dir
        super().__setitem__(name, node)
        self.dirs += node.is_dir

    def __delitem__(self, name: bytes) -> None:
        self.dirs -= self[name].is_dir
        super().__delitem__(name)

    def pop(self, *a):   # not used: would bypass the count
        raise NotImplementedError("Children.pop: use del")


class Node:
    """One file, directory or symlink of the mount's view.

    Fields marked (lock) change only under ``OpLog.lock``; fields marked (position lock)
    only under ``Inodes.position_lock``, by the sequencer thread; all others belong to the
    trio thread.
    """
    __slots__ = ("ino", "mode", "uid", "gid", "size", "atime", "mtime", "ctime", "parent", "name",
                 "children", "target", "content", "backing_parent", "backing_name",
                 "writers", "appenders", "opens", "nlink", "lookups", "dirty", "dirty_since",
                 "publish_ops", "last_seq", "xattrs", "staged", "generation", "journal_state",
                 "journal_content", "passthrough_opens", "open_copy", "truncated", "listed_at", "read_at", "listed_version", "backing_version", "checked_at", "rdev",
                 "links", "backing_links", "nodeid", "kernel_ids")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, parent: Node | None, name: bytes) -> None:
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.size = 0
        t = now_ns()
        self.atime = self.mtime = self.ctime = t
        self.parent = parent                          # place in the mount; None once deleted
        self.name = name
        self.children: Children | None = None   # directories: None until loaded
        self.target = b""                                # symlinks
        self.rdev = 0                                    # device nodes: the device number
        self.content: Any = None                         # (lock) files: the store's handle
                                                         # (store/api.py); None = not cached
        self.backing_parent: Node | None = None          # (position lock) position in the
        self.backing_name = b""                          # backing; parent None = absent there
        self.writers = 0                                 # open handles that may write
        self.appenders = 0                               # of those, opened with O_APPEND
        self.opens = 0
        self.passthrough_opens = 0                       # of those, passed through by the kernel
        self.nlink = 1
        self.lookups = 0                                 # the kernel's references (FUSE lookup count)
        # the node id new lookups give the kernel: ``ino``, or an alias once a kernel inode of
        # it was passed through to its backing file (``Inodes.realias``); the aliases the
        # kernel may still hold, with their lookup counts (None: none ever made)
        self.nodeid = ino
        self.kernel_ids: dict[int, int] | None = None
        self.dirty = False                               # changed since its last snapshot
        self.dirty_since = 0.0
        self.publish_ops: list[QueuedPublish] = []       # (lock) queued publish ops of this file
        self.last_seq = 0                                # seq of the last op that involved it
        self.xattrs: dict[bytes, bytes] | None = None    # None: not read from the backing yet
        self.staged: Staged | None = None                # content written through to the backing
        # a writer passed through, open long: (name of the staged copy of its memory file in
        # the backing, the memory file's (size, mtime, ctime) copied); WriteThrough owns it
        self.open_copy: tuple[bytes, Any] | None = None
        self.generation = 0                              # bumped when its backing copy changes:
                                                         # readers reopen theirs (Handles.read)
        self.journal_state = JournalState.NONE           # (lock) its last journal record
        self.journal_content: Any = None                 # (lock) content held for a FLUSHED record
        self.truncated = False                           # shrunk since its last snapshot
        self.listed_at = 0.0                             # directories: when the listing last
                                                         # merged in, or found unchanged, began
                                                         # (monotonic): opendir lists again after
                                                         # the coherence timeout
        self.read_at = 0.0                               # directories: when the last listing
                                                         # that read the backing directory began
                                                         # (a name missing from it was missing
                                                         # then: Core._lookup)
        self.listed_version: tuple[int, int, int] | None = None   # directories: the backing
                                                         # directory's (ino, mtime, ctime) then
        self.backing_version: tuple[int, int, int] | None = None   # (position lock) files:
                                                         # (ino, size, mtime_ns) of the backing
                                                         # copy that matches this node's content
        self.checked_at = 0.0                            # when that was last compared (monotonic)
        # hard links: the names beyond (parent, name), and the positions in the backing
        # beyond (backing_parent, backing_name) (position lock); None while there are none.
        # Invariant: nlink >= 1 + len(links) while a file is in the mount; more where the
        # backing has names of it in directories not listed yet (Coherence._attach).
        self.links: list[tuple[Node, bytes]] | None = None
        self.backing_links: list[tuple[Node, bytes]] | None = None

    def entries(self) -> Children:
        """The entries of a directory whose listing is loaded (requests on a directory
        load it first; ``children`` is None until then, and for anything but a directory)."""
        assert self.children is not None, f"directory {self.name!r} not loaded"
        return self.children

    @property
    def is_dir(self) -> bool:
        return statmod.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return statmod.S_ISREG(self.mode)

    @property
    def is_link(self) -> bool:
        return statmod.S_ISLNK(self.mode)

    @property
    def is_special(self) -> bool:
        """A FIFO, socket or device node: a name with a mode (and a device number) only."""
        return not (self.is_reg or self.is_dir or self.is_link)

    # -- names and positions (hard links) ------------------------------------------------
    def names(self) -> list[tuple[Node, bytes]]:
        """Every name of the node in the mount, the first one (``parent``/``name``) first."""
        if self.parent is None:
            return []
        return [(self.parent, self.name)] + (self.links or [])

    def set_names(self, names: list[tuple[Node, bytes]]) -> None:
        if names:
            (self.parent, self.name), rest = names[0], names[1:]
        else:
            self.parent, rest = None, []
        self.links = rest or None

    def add_name(self, parent: Node, name: bytes) -> None:
        self.set_names(self.names() + [(parent, name)])

    def rename_name(self, old: tuple[Node, bytes], new: tuple[Node, bytes] | None) -> None:
        """Move the name ``old`` to ``new``; None drops it (the next one becomes the first)."""
        self.set_names(_replaced(self.names(), old, new))

    def positions(self) -> list[tuple[Node, bytes]]:
        """Every position of the node in the backing (hold position_lock)."""
        if self.backing_parent is None:
            return []
        return [(self.backing_parent, self.backing_name)] + (self.backing_links or [])

    def set_positions(self, positions: list[tuple[Node, bytes]]) -> None:
        if positions:
            (self.backing_parent, self.backing_name), rest = positions[0], positions[1:]
        else:
            self.backing_parent, rest = None, []
        self.backing_links = rest or None

    def position_at(self, parent: Node | None, name: bytes) -> tuple[Node, bytes] | None:
        """The backing position of the name ``parent``/``name`` the node had when an op was
        queued, or None if that name is absent from the backing. Applied in order, ops leave
        each name where the mount had it when they were queued (hold position_lock)."""
        for pos in self.positions():
            if pos[0] is parent and pos[1] == name:
                return pos
        return None

    def move_position(self, old: tuple[Node, bytes], new: tuple[Node, bytes] | None) -> None:
        """Move the position ``old`` to ``new``; None drops it (hold position_lock)."""
        self.set_positions(_replaced(self.positions(), old, new))

    @property
    def appended_only(self) -> bool:
        """Open for writing, every writer with O_APPEND, and not shrunk since its last
        version: the backing's copy is always a prefix of it."""
        return bool(self.writers) and self.appenders == self.writers and not self.truncated


def _replaced(pairs: list[tuple[Node, bytes]], old: tuple[Node, bytes],
              new: tuple[Node, bytes] | None) -> list[tuple[Node, bytes]]:
    out = []
    for pair in pairs:
        if pair[0] is old[0] and pair[1] == old[1]:
            if new is not None:
                out.append(new)
        else:
            out.append(pair)
    return out


def mount_path(node: Node) -> bytes | None:
    """The node's path relative to the mount root (b"" for the root); None once deleted."""
    parts = []
    while node.parent is not None:
        parts.append(node.name)
        node = node.parent
    if node.ino != ROOT_INODE:
        return None
    parts.reverse()
    return b"/".join(parts)


def name_path(parent: Node, name: bytes) -> bytes | None:
    """The mount path of the name ``name`` in ``parent`` (one of a file's hard links)."""
    d = mount_path(parent)
    return None if d is None else (d + b"/" + name if d else name)


def node_path(node: Node) -> str:
    """The node's path relative to the mount root, for humans."""
    parts = []
    while node.parent is not None:
        parts.append(node.name)
        node = node.parent
    if node.ino != ROOT_INODE:
        parts.append(b"(deleted)")
    return os.fsdecode(b"/".join(reversed(parts))) or "."


class Staged:
    """The staged file of a written-through file: a temporary file in the backing's staging
    directory that holds the file's content instead of the pool.

    ``fd`` is -1 while the cached blocks are still being copied out. At the last close the
    staged file is handed to the publish op (``queued``), which owns it from then on: it
    fsyncs it and renames it over the final name in order, like any upload. Calls on ``fd``
    pin it (``users``) so that a publish or discard meanwhile closes it only afterwards.
    """
    __slots__ = ("dir_fd", "name", "fd", "queued", "users", "closing", "read_only")

    def __init__(self, dir_fd: int = -1, fd: int = -1, name: bytes = b"") -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.fd = fd
        self.queued = False   # handed to a publish op, which owns it now
        self.users = 0        # (lock) calls on fd in flight
        self.closing = False  # (lock) close when the last user is done
        # fd is open for reading only: a recovery found the backing refusing writes; the
        # publish opens it again for writing first (Uploads.writable_staged)
        self.read_only = False

    def close(self, close_fd) -> None:
        """Close now, or when the last call in flight ends (hold OpLog.lock)."""
        self.closing = True
        if self.users:
            return
        for fd in (self.fd, self.dir_fd):
            if fd >= 0:
                close_fd(fd)
        self.fd = self.dir_fd = -1


class Snapshot:
    """An immutable picture of a file taken at its last close: what one upload writes."""
    __slots__ = ("content", "size", "mode", "uid", "gid", "times", "xattrs", "staged")

    def __init__(self, node: Node, content: Any) -> None:
        self.staged = node.staged
        self.content = content   # a reference of its own (Store.share); None: staged only
        self.size = node.size
        self.mode = node.mode
        self.uid = node.uid
        self.gid = node.gid
        self.times = (node.atime, node.mtime)
        self.xattrs = dict(node.xattrs or {})


class KernelNotices:
    """What the cache tells the kernel when another node changed the backing under it
    (``fuse.notices.KernelCacheNotices`` on a mount; this one, which tells nobody, in process)."""

    def forget_entry(self, parent_ino: int, name: bytes) -> None:
        """The kernel drops its entry of ``name`` in directory ``parent_ino``, at once."""

    def forget_attrs(self, node: Node) -> None:
        """The kernel asks again for the attributes of ``node`` before it next uses them
        (under each node id it may hold for it: ``Inodes.kernel_ids``)."""

    def appeared(self, parent_ino: int, name: bytes) -> None:
        """``name`` joined the view of directory ``parent_ino`` from the backing (another
        node made it): an answer "missing" the kernel may keep for it is dropped."""

    def looking(self, parent_ino: int, name: bytes) -> None:
        """A LOOKUP of the name came: the kernel keeps no answer for it now."""

    def missing(self, parent_ino: int, name: bytes) -> None:
        """The kernel was told the name is missing, an answer it keeps a while."""

    async def settled(self) -> None:
        """Returns once what ``appeared`` queued for the kernel was sent."""

    def hold(self, node: Node) -> bool:
        """The kernel may keep the answer about ``node`` given now (its entry, its attributes)
        until this mount's pending change of it lands (True), not only for the kernel timeout."""
        return False

    def landed(self, node: Node) -> None:
        """(the flusher's thread) An op of ``node`` reached the backing."""

    def let_go(self, node: Node) -> None:
        """``node`` may have nothing pending any more (its last writer closed it)."""

    async def run(self, quiescent: Callable[[Node], bool]) -> None:
        """Background: answers held (``hold``) are dropped once ``quiescent``."""

    def held_state(self) -> dict[str, Any]:
        """``status``'s ``kernel_held``."""
        return {"on": False, "files": 0, "released": 0}


class FsError(OSError):
    """The core's one error type: an errno for the caller (the FUSE reply, a CLI exit) and a
    message for the log. Anything that is not an OSError reaching the FUSE adapter is a bug:
    it is logged with its traceback and answered EIO (``fuse.operations.errno_of``)."""


def err(code: int, msg: str = "") -> FsError:
    return FsError(code, msg or os.strerror(code))
