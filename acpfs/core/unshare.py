"""Content a writer must not share: ``unshared``.

Owns nothing: the step before an open for writing (``Handles._open``) or a truncate
(``Core.setattr``) that makes the file's content private to this mount's next writes,
copying what a snapshot or journal record still holds (Store.shared).
"""

from __future__ import annotations

import trio

from ..cache.files import Files
from ..node import Node
from .writethrough import WriteThrough

UNSHARED_POLL = 0.005   # s between looks at a memory file an upload still holds


async def unshared(files: Files, wt: WriteThrough, node: Node, trunc: bool) -> bool:
    """Before an open for writing: content a snapshot or journal record still holds is
    copied, so that the kernel writes a memory file nobody else reads. Not while the
    file is open with passthrough: the kernel holds that memory file, so the writer
    waits until the upload that holds it lands. Returns True when nothing was waited
    for; after a wait everything the caller checked may have changed (look again)."""
    store = files.store
    content = node.content
    if content is None or not store.shared(content):
        return True
    if node.ino in wt.slots:
        await wt.settle(node)
    elif node.passthrough_opens:
        await wt.wait_seq(node.last_seq)
        await trio.sleep(UNSHARED_POLL)   # the upload's reference goes just after its seq
    else:
        # copied in a worker thread with the slot held: no open passes through to the
        # old memory file meanwhile (Handles.open settles first)
        size = 0 if trunc else node.size     # O_TRUNC: nothing worth copying
        async with wt.hold(node, "copy for a writer"):
            copy = await trio.to_thread.run_sync(store.copy, content, size)
            with files.oplog.lock:
                if node.content is content:
                    node.content = copy
                    store.drop(content)
                else:
                    store.drop(copy)         # replaced meanwhile
    return False
