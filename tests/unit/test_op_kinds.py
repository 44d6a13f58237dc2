"""Each kind of op is known everywhere a kind must be (ops.py: adding a kind), and its
journal record is what the journal's layout says and the replay reads back."""

from __future__ import annotations

import inspect

from acpfs.oplog import ops
from acpfs.daemon import recovery
from acpfs.flusher.flusher import Flusher
from acpfs.oplog.journal import LAYOUT, Record
from acpfs.node import OpKind
from harness import write_file


def op_classes() -> list[type[ops.Op]]:
    return [c for _, c in inspect.getmembers(ops, inspect.isclass)
            if issubclass(c, ops.Op) and "kind" in c.__dict__]


def test_every_kind_has_one_class_an_applier_a_layout_and_a_replay():
    classes = op_classes()
    assert sorted(c.kind for c in classes) == sorted(OpKind)        # one class per kind
    assert set(Flusher.APPLY) == set(classes)
    assert set(LAYOUT) >= {str(k) for k in OpKind}
    assert set(recovery.Replayer.BY_KIND) == {str(k) for k in OpKind} - {"publish"}


def test_the_ops_of_a_namespace_change_carry_their_records(core):
    """Records made by the op classes decode to what was encoded, with the fields the
    layout gives their kind (the journal writes only those)."""
    cache = core.cache
    core.backing.inject("mkdir", hang=True)      # the first op holds every later one queued
    d = cache.names.mkdir(cache.inodes.root, b"d", 0o755, 0, 0)
    f = write_file(cache, b"f", b"x" * 10, parent=d)
    cache.files.release(f, True)
    cache.names.link(f, cache.inodes.root, b"g")
    cache.names.rename(d, b"f", cache.inodes.root, b"h")
    cache.names.setattr(f, mode=0o600)
    cache.names.set_xattr(f, b"user.k", b"v")
    cache.names.symlink(cache.inodes.root, b"s", b"h", 0, 0)
    cache.names.unlink(cache.inodes.root, b"g")
    seen = set()
    for op in list(core.oplog.queue):
        rec = op.record(cache.store.ref)
        assert rec.seq == op.seq and rec.kind == op.kind and rec.ino == op.node.ino
        assert Record.decode(rec.encode()) == rec
        seen.add(op.kind)
    core.backing.clear()
    core.drain()
    assert seen >= {OpKind.MKDIR, OpKind.PUBLISH, OpKind.LINK, OpKind.RENAME, OpKind.SETATTR,
                    OpKind.XATTR, OpKind.SYMLINK, OpKind.UNLINK}
