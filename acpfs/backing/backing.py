"""The backing directory: every system call acpfs makes on it lives in ``Backing`` and the
pieces it is made of.

Safety invariant (contract 9): the daemon never follows a symlink or ``..`` out of the
backing root. Paths are never handed to the kernel as strings: each directory is reached
from a file descriptor of the root with ``openat(O_NOFOLLOW | O_DIRECTORY)`` one name at a
time, names ``.``, ``..`` and names with ``/`` are refused, and every other call is relative
to such a directory descriptor with ``follow_symlinks=False`` where the call follows.

Atomicity invariant (contract 3): file content reaches a final name only through
``write_temp`` (temporary name in the same directory, data, owner, mode, times, fsync)
followed by ``publish`` (rename over the final name, fsync of the directory).

Boundary invariant: ``Backing`` (with its pieces) is the only place that makes system calls
on the backing directory or on descriptors opened in it (reads, writes, truncates and fsyncs
of staged files included, and the node records of global order), so a test can wrap a
``Backing`` to fail or hang any one call (tests/unit/faulty.py). Nothing here retries or
knows about the cache; callers (``flusher``, ``writethrough``, ``recovery``, ``peers``) do
that.

``Backing`` is the one object the others hold; it is made of pieces, one module each, by
what they own (each a class whose methods call one another through ``self``, so that a
wrapped ``Backing`` sees the inner calls too):

- ``backing_names``: the names acpfs keeps in the backing, and the errors (no calls);
- ``backing_root`` (``RootDir``): the root descriptor, reaching directories from it, and a
  backing that went away and came back (stale handles);
- ``backing_reads`` (``TreeReads``): listings, entries, directory versions, files opened
  for reading, symlink targets, xattrs;
- ``backing_changes`` (``TreeChanges``): namespace operations and metadata changes, each
  fsynced; entries moved aside;
- ``backing_files`` (``StagedFiles``): temporary and staged files, publishing, and the calls
  on descriptors opened in the backing;
- ``backing_records`` (``NodeRecords``): the node records' directory of global order.

The names other modules import from here (``NODES_DIR``, ``MissingDir``, ``flat_name``, ...)
stay importable from here.
"""

from __future__ import annotations

from .changes import TreeChanges
from .staging import StagedFiles
from .names import (CONFLICTS_DIR, IS_ROOT, NODES_DIR, RECOVERED_DIR, STAGED, STALE,
                            TEMP_PREFIX, Comps, MissingDir, NotEmpty, check_name, flat_name,
                            is_internal_name, new_instance, staged_ino, staging_dir_of)
from .reads import TreeReads
from .records import NodeRecords
from .root import RootDir

__all__ = ["Backing", "CONFLICTS_DIR", "IS_ROOT", "NODES_DIR", "RECOVERED_DIR", "STAGED", "STALE",
           "TEMP_PREFIX", "Comps", "MissingDir", "NotEmpty", "check_name", "flat_name",
           "is_internal_name", "new_instance", "staged_ino", "staging_dir_of"]


class Backing(RootDir, TreeReads, TreeChanges, StagedFiles, NodeRecords):
    """The backing directory of one daemon ``instance``; ``dead_instance`` is the daemon
    whose journal this one recovers (its leftovers are this daemon's to clean up)."""

    def __init__(self, root: str, instance: str | None = None, dead_instance: str | None = None) -> None:
        RootDir.__init__(self, root)
        TreeChanges.__init__(self)
        StagedFiles.__init__(self, instance, dead_instance)
