"""The cache: the mount's view and file contents, independent of FUSE, as five owners.

Holds, built in this order, each owning its own state (their module docstrings say what,
and their lock rules):

- ``inodes`` (``inodes.Inodes``): the inode table, the root, files met under several
  names in the backing, and the backing positions with ``position_lock``;
- ``files`` (``files.Files``): the content of regular files, opens, dirty files and their
  snapshots, journal states, eviction and the passthrough writers;
- ``admission`` (``admission.Admission``): which writers the kernel may write for
  (passthrough), and the sizes names had that decide it;
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

``Cache`` itself owns nothing: it builds the five, and callers reach each through it
(``cache.files.write``, ``cache.names.rename``, ...), so a call says whose state it
changes.
"""

from __future__ import annotations

from ..backing.backing import Backing
from .admission import Admission
from .coherence import Coherence
from ..store.api import Store
from .files import Files
from .inodes import Inodes
from .namespace import Namespace
from ..oplog.log import OpLog
from ..node import KernelNotices


class Cache:
    def __init__(self, oplog: OpLog, backing: Backing, store: Store,
                 kernel: KernelNotices = KernelNotices()) -> None:
        self.oplog = oplog
        self.backing = backing
        self.store = store
        self.kernel = kernel      # tells the kernel to forget what another node changed
        self.inodes = Inodes(backing.stat_root())
        self.files = Files(oplog, self.inodes, backing, store)
        self.admission = Admission(self.files)   # which writers the kernel may write for
        self.names = Namespace(oplog, self.inodes, self.files, kernel)
        self.coherence = Coherence(oplog, backing, self.inodes, self.files, self.names, kernel)
