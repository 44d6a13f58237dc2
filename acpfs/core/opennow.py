"""OPENs answered at once: ``OpensNow``.

Owns nothing but the choice: which read-only OPENs are answered without a coroutine, from
the extension's hook (acpfs/fuse/_atonce.c, which counts them, by way of
``AtOnce.open``, acpfs/fuse/atonce.py).

Why: every request answered in Python costs a trip through pyfuse3 (a coroutine, a trio
task) besides the handler's own work; measured on 2 vCPUs, a LOOKUP of a missing name took
52 us through a C daemon, 113-177 us through a pyfuse3 daemon that does nothing and 250-340
us through acpfs, and after the daemon idled (0.01-2 s) 140-205, 375-608 and 545-980 us
(docs/benchmarks.md, "An OPEN answered at once"). A load opens each file once or twice
(`torch.load(mmap=True)` twice, `np.memmap` after an `open` twice), a resume of many files
opens each again, and every one of those OPENs went through a coroutine although most wait
for nothing.

What: the steps ``Handles.open`` takes for a reader, where none of them would wait: a
regular file with one name, neither staged nor held by the write-through, on a local
backing whose calls run on the event loop (``BackingCalls.run_now``: the flusher does not
hold the position lock). Its close-to-open check (one lstat, ``Loader.unchanged_now``)
finds the version this mount has, and then the open is passed through to the file's memory
file (a copy in the cache), shares the backing file other opens of its kernel inode are
passed through to, or, the first open of a file the cache does not hold, opens the backing
file (which checks the version itself) and is passed through to it. Anything else (a
writer, a version that changed, a check or an open of the backing file under way, the
kernel's page cache mode, no passthrough) returns None, and ``Handles.open`` takes the
request as before, from the start: nothing here is half done then.

Threads: the trio thread (the hook runs inside pyfuse3's request loop, with the GIL held).
"""

from __future__ import annotations

import os
import time

from .handles import Handles


class OpensNow:
    def __init__(self, handles: Handles) -> None:
        self.handles = handles

    def open(self, ino: int, flags: int) -> tuple[int, int] | None:
        """(file handle, backing id) of a read-only open answered at once, or None."""
        h = self.handles
        node = h.inodes.nodes.get(ino)
        kernel = h.kernel
        if (flags & os.O_ACCMODE) != os.O_RDONLY or node is None or kernel is None \
                or not kernel.granted() or not node.is_reg or node.links \
                or node.staged is not None or node.ino in h.wt.slots \
                or h.page_cached.get(node.ino) \
                or (node.parent is None and node.content is None and node.backing_parent is None) \
                or (h.peer_reads is not None and h.peer_reads.wants(node)):
            return None   # (another node's RAM may hold it: ``Handles.open`` asks)
        opens = h.kernel_opens.get(ino, 0)
        first = h.cold.first(ino, node, opens)
        if not first and not h.loader.unchanged_now(node):
            return None
        h.cold.conflicts(ino, node, False)   # ESTALE, as Handles.open answers it
        claimed = h.cold.claim(ino, node, False, opens)
        if first != (claimed == "open") or (not claimed and node.content is None):
            return None
        h.kernel_opens[ino] = opens + 1
        try:
            if claimed:
                served = h.cold.open_now(ino, node, claimed)
                if served is None:
                    h.closed_on(ino)
                    return None
                if first:
                    node.checked_at = time.monotonic()   # as Loader.revalidated would have
                fh = h.opened_cold(ino, node, served, claimed, bool(flags & os.O_APPEND))
                return fh, served.backing_id
            handle, _, backing_id = h.prepared(ino, node, flags, 0)
            if not backing_id:
                h.closed_on(ino)
                return None
            return h.registered(handle, flags), backing_id
        except BaseException:
            if h.kernel_opens.get(ino, 0) > opens:
                h.closed_on(ino)
            raise
