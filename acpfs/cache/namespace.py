"""The namespace: the tree of nodes the mount shows, and every change of a name in it.

The inode table it changes is ``inodes.Inodes``'s.

``Namespace``, the names: lookup, create, mkdir, symlink, mknod, unlink, rmdir, rename,
link, setattr and extended attributes of the view. Every change is queued on the op log
(``oplog.OpLog.push``), which journals it and hands it to the flusher; the content of a
new or removed file is ``files.Files``'s. The view is the backing tree, loaded one
directory at a time on first use (``coherence.Coherence``), overlaid with every change
made through the mount.

Threads: the trio thread, and recovery's replay on the main thread before the sequencer
starts; ``backing_path`` and the positions also from worker threads and the sequencer,
under ``position_lock``. Nothing here does I/O on the backing. docs/concurrency.md has the
whole picture.
"""

from __future__ import annotations

import errno
import stat as statmod
import time
from typing import TYPE_CHECKING

from ..backing.backing import check_name, is_internal_name
from ..oplog.log import OpLog
from .inodes import Inodes
from ..oplog.ops import Link, Mkdir, Mknod, Rename, Rmdir, SetAttr, SetXattr, Symlink, Unlink
from ..node import Children, KernelNotices, Node, err, mount_path, name_path, now_ns

if TYPE_CHECKING:
    from .files import Files


def check_not_reserved(name: bytes) -> None:
    """Names of acpfs's own temporary files cannot be created through the mount."""
    if is_internal_name(name):
        raise err(errno.EPERM, "names starting with .acpfs- are reserved")


class Namespace:
    def __init__(self, oplog: OpLog, inodes: Inodes, files: Files,
                 kernel: KernelNotices = KernelNotices()) -> None:
        self.oplog = oplog        # where every change is queued
        self.inodes = inodes      # where new nodes are numbered
        self.files = files        # the content of files made and removed here
        self.kernel = kernel      # forgets attributes changed without the kernel asking
        self.root = inodes.root

    def lookup(self, parent: Node, name: bytes) -> Node:
        kids = parent.children
        assert kids is not None, "directory not loaded"
        node = kids.get(name)
        if node is None:
            raise err(errno.ENOENT)
        return node

    def _free_name(self, parent: Node, name: bytes) -> dict[bytes, Node]:
        check_name(name)
        check_not_reserved(name)
        if len(name) > 255:
            raise err(errno.ENAMETOOLONG)
        self._check_linked(parent)
        kids = parent.children
        assert kids is not None, "directory not loaded"
        if name in kids:
            raise err(errno.EEXIST)
        return kids

    def _check_linked(self, parent: Node) -> None:
        """A directory removed (here, or by another node: ``Coherence.removed_elsewhere``)
        takes no new entries; the kernel refuses that only for removals it saw."""
        if parent is not self.root and parent.parent is None:
            raise err(errno.ENOENT)

    def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self.inodes.new_node(statmod.S_IFREG | statmod.S_IMODE(mode), uid, gid, parent, name)
        node.xattrs = {}
        kids[name] = node
        self.files.created(node)
        parent.mtime = parent.ctime = node.mtime
        return node

    def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self.inodes.new_node(statmod.S_IFDIR | statmod.S_IMODE(mode), uid, gid, parent, name)
        node.children = Children()
        node.xattrs = {}
        node.nlink = 2
        node.listed_at = node.read_at = time.monotonic()   # empty: this mount's view is whole
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        # the mode and owner it was made with: a later chmod is an op of its own, after it
        self.oplog.push(Mkdir(node, parent, name, uid, gid))
        return node

    def symlink(self, parent: Node, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        kids = self._free_name(parent, name)
        node = self.inodes.new_node(statmod.S_IFLNK | 0o777, uid, gid, parent, name)
        node.target = target
        node.size = len(target)
        node.xattrs = {}
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        self.oplog.push(Symlink(node, parent, name, uid, gid))
        return node

    def mknod(self, parent: Node, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Node:
        """A FIFO, socket or device node: a name with a mode, persisted by MKNOD."""
        kids = self._free_name(parent, name)
        node = self.inodes.new_node(mode, uid, gid, parent, name)
        node.rdev = rdev
        node.xattrs = {}
        kids[name] = node
        parent.mtime = parent.ctime = node.mtime
        self.oplog.push(Mknod(node, parent, name, uid, gid))
        return node

    def unlink(self, parent: Node, name: bytes) -> None:
        node = self.lookup(parent, name)
        if node.is_dir:
            raise err(errno.EISDIR)
        path = name_path(parent, name)
        self._remove(parent, name, node)
        self.oplog.push(Unlink(node, parent, name, path, node.names() or None))

    def rmdir(self, parent: Node, name: bytes) -> None:
        node = self.lookup(parent, name)
        if not node.is_dir:
            raise err(errno.ENOTDIR)
        assert node.children is not None, "directory not loaded"
        if node.children:
            raise err(errno.ENOTEMPTY)
        path = mount_path(node)
        self._remove(parent, name, node)
        self.oplog.push(Rmdir(node, parent, name, path))

    def _remove(self, parent: Node, name: bytes, node: Node) -> None:
        del parent.entries()[name]
        parent.mtime = parent.ctime = now_ns()
        if node.links:   # one of several names: the file stays, under the others
            node.rename_name((parent, name), None)
            node.ctime = parent.ctime
            self.one_name_less(node)
            return
        node.nlink = 0
        node.parent = None
        self.files.cancel(node)
        if node.opens == 0:
            self.files.drop(node)

    def one_name_less(self, node: Node) -> None:
        """A file with several names lost one of them (already gone from ``node.names()``).
        Invariant: its link count never falls below the names the mount has (it may count
        more: names in the backing in directories not listed yet)."""
        node.nlink = max(node.nlink - 1, len(node.names()))
        self.oplog.rejournal(node)   # its record may give the name it lost

    def rename(self, p1: Node, n1: bytes, p2: Node, n2: bytes, noreplace: bool = False) -> None:
        node = self.lookup(p1, n1)
        self._check_linked(p2)
        kids2 = p2.children
        assert kids2 is not None, "directory not loaded"
        check_name(n2)
        check_not_reserved(n2)
        if len(n2) > 255:
            raise err(errno.ENAMETOOLONG)
        target = kids2.get(n2)
        if target is node:
            return
        if target is not None:
            if noreplace:
                raise err(errno.EEXIST)
            if node.is_dir and not target.is_dir:
                raise err(errno.ENOTDIR)
            if target.is_dir and not node.is_dir:
                raise err(errno.EISDIR)
            if target.is_dir:
                assert target.children is not None, "directory not loaded"
                if target.children:
                    raise err(errno.ENOTEMPTY)
            self._remove(p2, n2, target)
        src_path = name_path(p1, n1)
        del p1.entries()[n1]
        kids2[n2] = node
        node.rename_name((p1, n1), (p2, n2))
        t = now_ns()
        p1.mtime = p1.ctime = p2.mtime = p2.ctime = node.ctime = t
        self.oplog.push(Rename(node, p2, n2, p1, n1, target, src_path))

    def link(self, node: Node, parent: Node, name: bytes) -> None:
        """One more name for a file, symlink or special file (a hard link): the same node,
        persisted as a link to its inode in the backing."""
        if node.is_dir:
            raise err(errno.EPERM, "hard links to directories are not allowed")
        if not node.nlink:
            raise err(errno.ENOENT)
        kids = self._free_name(parent, name)
        src_path = mount_path(node)
        kids[name] = node
        node.add_name(parent, name)
        node.nlink += 1
        parent.mtime = parent.ctime = node.ctime = now_ns()
        self.oplog.push(Link(node, parent, name, src_path))
        self.oplog.rejournal(node)   # a "flushed" record names every name of the file

    def setattr(self, node: Node, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, atime: int | None = None, mtime: int | None = None) -> None:
        """Owner, mode and times. Size changes go through ``truncate``."""
        if mode is not None:
            node.mode = statmod.S_IFMT(node.mode) | statmod.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime is not None:
            node.atime = atime
        if mtime is not None:
            node.mtime = mtime
        node.ctime = now_ns()
        if node.is_reg and node.dirty:
            return  # the coming snapshot carries the new attributes
        times = (node.atime, node.mtime) if (atime is not None or mtime is not None) else None
        self.oplog.push(SetAttr(node, None if mode is None else node.mode, uid, gid, times))

    def set_xattr(self, node: Node, key: bytes, value: bytes | None) -> None:
        assert node.xattrs is not None, "xattrs not loaded"
        if value is None:
            if key not in node.xattrs:
                raise err(errno.ENODATA)
            del node.xattrs[key]
        else:
            node.xattrs[key] = value
        node.ctime = now_ns()
        if node.is_link or (node.is_reg and node.dirty):
            return
        self.oplog.push(SetXattr(node, key, value))

    def kill_priv(self, node: Node, chown: bool = False) -> None:
        """As the kernel does for a local filesystem: a write or truncate by a user other
        than root (who has CAP_FSETID), or any change of owner, clears setuid, and setgid
        where the group may execute (a setgid file without it is a locking mark, kept)."""
        mode = node.mode & ~statmod.S_ISUID
        if node.mode & statmod.S_IXGRP:
            mode &= ~statmod.S_ISGID
        if mode != node.mode:
            self.setattr(node, mode=mode)
            if not chown:
                self.kernel.forget_attrs(node)   # the kernel asks for the new mode
