"""The cache: the mount's view and file contents, independent of FUSE, as four owners.

Holds, built in this order, each owning its own state (their module docstrings say what,
and their lock rules):

- ``inodes`` (``namespace.Inodes``): the inode table, the root, files met under several
  names in the backing, and the backing positions with ``position_lock``;
- ``files`` (``files.Files``): the content of regular files, opens, dirty files and their
  snapshots, journal states, eviction and the passthrough writers;
- ``names`` (``namespace.Namespace``): every change of a name (create, mkdir, rename,
  link, unlink, setattr, xattrs);
- ``coherence`` (``coherence.Coherence``): loading directories from the backing, and what
  other writers of the backing changed.

Every change they make is queued on the op log (``oplog.OpLog``), which journals it and
hands it to the flusher; its ``lock`` is the one lock they share (a ``threading.Condition``:
the sequencer waits on it). Lock order: ``Inodes.position_lock``, then the op log's
``lock``. They do no I/O on the backing but listing and reading through ``Backing``, and
know nothing of FUSE or trio: ``core`` and ``writethrough`` call them, the unit tests drive
them directly.

``Cache`` itself owns nothing: it builds the four and keeps, as one-line forwards to their
owners, the names that the flusher, recovery and control call on it.
"""

from __future__ import annotations

from .backing import Backing
from .coherence import Coherence
from .content import Store
from .files import Files
from .namespace import Inodes, Namespace
from .oplog import OpLog
from .types import KernelNotices


def _forward(part: str, name: str) -> property:
    """``cache.<name>`` is ``cache.<part>.<name>``."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"``{part}.{name}``")


class Cache:
    def __init__(self, oplog: OpLog, backing: Backing, store: Store,
                 kernel: KernelNotices = KernelNotices()) -> None:
        self.oplog = oplog
        self.backing = backing
        self.store = store
        self.kernel = kernel      # tells the kernel to forget what another node changed
        self.inodes = Inodes(backing.stat_root())
        self.files = Files(oplog, self.inodes, backing, store)
        self.names = Namespace(oplog, self.inodes, self.files, kernel)
        self.coherence = Coherence(oplog, backing, self.inodes, self.files, self.names, kernel)

    # -- what the flusher, recovery and control call on the cache ---------------------------
    root = _forward("inodes", "root")
    nodes = _forward("inodes", "nodes")
    linked = _forward("inodes", "linked")
    position_lock = _forward("inodes", "position_lock")
    present = _forward("inodes", "present")
    backing_path = _forward("inodes", "backing_path")
    list_backing = _forward("coherence", "list_backing")
    attach_listing = _forward("coherence", "attach_listing")
    create = _forward("names", "create")
    mkdir = _forward("names", "mkdir")
    symlink = _forward("names", "symlink")
    mknod = _forward("names", "mknod")
    unlink = _forward("names", "unlink")
    rmdir = _forward("names", "rmdir")
    rename = _forward("names", "rename")
    link = _forward("names", "link")
    setattr = _forward("names", "setattr")
    set_xattr = _forward("names", "set_xattr")
    lru = _forward("files", "lru")
    dirty_nodes = _forward("files", "dirty_nodes")
    snapshot = _forward("files", "snapshot")
    note_persisted = _forward("files", "note_persisted")
    state_of = _forward("files", "state_of")
    subtree_seq = _forward("files", "subtree_seq")
