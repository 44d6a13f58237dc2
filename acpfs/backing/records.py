"""The node records' directory, ``<backing>/.acpfs-nodes/``: the system calls of global order
across nodes (acpfs/peers.py keeps the protocol; this keeps the I/O).

What it owns (``NodeRecords``, a piece of ``Backing``): the calls on the records directory
and on the records in it. A record is an empty file whose *name* holds everything, so the
calls are: make the directory (mode 1777: every user's mounts keep records there; the sticky
bit keeps each one's own), look at it, list it, look at one record's owner, create a record,
replace one by another in one step (a rename), and remove one. No state of its own: the
root descriptor and its stale-handle recovery are ``RootDir``'s; each call that meets a
stale root is made once more after a reopen (``_stale_retry``), and any other error is the
caller's (``Peers`` retries at its next heartbeat).

The directory is opened anew, by name, for every listing: an NFS client revalidates a
directory opened by path (close-to-open), so a listing shows every rename that completed
before it started. Records are reached by a path relative to the root
(``.acpfs-nodes/<name>``), as they always were.
"""

from __future__ import annotations

import os

from .names import NODES_DIR, check_name


class NodeRecords:
    """Calls on the records directory (needs ``RootDir`` beside it)."""

    def make_records_dir(self) -> int | None:
        """Make the records directory, mode 1777; returns the owner the backing gave it, None
        if it was there already."""
        def make() -> int | None:
            try:
                os.mkdir(NODES_DIR, 0o755, dir_fd=self.root_fd)
                # every user's mounts keep records here; the sticky bit keeps each one's own
                os.chmod(NODES_DIR, 0o1777, dir_fd=self.root_fd)
            except FileExistsError:
                return None
            return os.stat(NODES_DIR, dir_fd=self.root_fd, follow_symlinks=False).st_uid
        return self._stale_retry(make)

    def stat_records_dir(self) -> os.stat_result:
        """lstat of the records directory (its owner and mode)."""
        return self._stale_retry(
            lambda: os.stat(NODES_DIR, dir_fd=self.root_fd, follow_symlinks=False))

    def list_records(self) -> list[tuple[bytes, int]]:
        """(name, inode) of every entry of the records directory, opened anew by name."""
        def names() -> list[tuple[bytes, int]]:
            fd = os.open(NODES_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root_fd)
            try:
                with os.scandir(fd) as it:
                    return [(os.fsencode(e.name), e.inode()) for e in it]
            finally:
                os.close(fd)
        return self._stale_retry(names)

    def stat_record(self, name: bytes) -> os.stat_result | None:
        """lstat of the record ``name`` (its owner, and whether it is a regular file); None if
        it is gone (renamed or removed since it was listed)."""
        check_name(name)
        try:
            return self._stale_retry(lambda: os.stat(NODES_DIR + b"/" + name, dir_fd=self.root_fd,
                                                     follow_symlinks=False))
        except FileNotFoundError:
            return None

    def create_record(self, name: bytes) -> int:
        """Create the empty record ``name``, exclusively; returns the owner the backing gave
        it (this daemon's user, or another where NFS squashes root). FileNotFoundError: the
        records directory is gone."""
        check_name(name)

        def make() -> int:
            fd = os.open(NODES_DIR + b"/" + name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         0o644, dir_fd=self.root_fd)
            try:
                return os.fstat(fd).st_uid
            finally:
                os.close(fd)
        return self._stale_retry(make)

    def replace_record(self, name: bytes, new: bytes) -> None:
        """Rename the record ``name`` to ``new``: a reader of the directory sees one or the
        other, never neither. FileNotFoundError: ``name`` is gone (or the directory)."""
        check_name(name)
        check_name(new)
        self._stale_retry(lambda: os.rename(NODES_DIR + b"/" + name, NODES_DIR + b"/" + new,
                                            src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd))

    def read_secret(self, name: bytes) -> tuple[bytes, os.stat_result] | None:
        """The bytes of the peer plane's secret ``name`` in the records directory and its
        fstat (owner, mode), read through one descriptor, not following a link; None if
        there is none."""
        check_name(name)

        def read() -> tuple[bytes, os.stat_result] | None:
            try:
                fd = os.open(NODES_DIR + b"/" + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, dir_fd=self.root_fd)
            except FileNotFoundError:
                return None
            try:
                st = os.fstat(fd)
                return os.read(fd, 4096), st
            finally:
                os.close(fd)
        return self._stale_retry(read)

    def create_secret(self, name: bytes, data: bytes) -> bool:
        """Make the secret ``name`` with ``data``, readable by its owner alone (0600),
        exclusively (no hard link: some backings have none; a reader that meets it before
        its bytes are written reads again: ``auth.Secret.load``). False if another node made
        it first (then theirs counts)."""
        check_name(name)

        def make() -> bool:
            try:
                fd = os.open(NODES_DIR + b"/" + name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=self.root_fd)
            except FileExistsError:
                return False
            try:
                os.fchmod(fd, 0o600)   # whatever the umask and the directory's defaults say
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        return self._stale_retry(make)

    def remove_record(self, name: bytes) -> bool:
        """Remove the record ``name``; False if it was gone already."""
        check_name(name)
        try:
            self._stale_retry(lambda: os.unlink(NODES_DIR + b"/" + name, dir_fd=self.root_fd))
        except FileNotFoundError:
            return False
        return True
