"""Which writers the kernel may write for (passthrough), without a mount: ``Files.headroom``
admits a writer only while the cache has room for a reservation for it and for every writer
passed through that is still open, counting persisted files as room without evicting them
for a guess; ``Files.trim`` evicts persisted files once written bytes push the cache past
its size. Each test fails on a cache that admits every writer or never trims."""

from __future__ import annotations

import os

import pytest

from acpfs.cache import files as files_module
from acpfs.store.api import status_of

from harness import BS, memory_files, write_file

RESERVE = 16 * BS            # what each writer passed through is kept free for, in these tests
LIMIT = 64 * BS              # the harness's cache: 64 blocks


@pytest.fixture
def parts(core, monkeypatch):
    monkeypatch.setattr(files_module, "PASS_WRITER_RESERVE", RESERVE)
    assert core.store.limit == LIMIT
    return core


def open_writer(cache, name: bytes):
    """Create ``name`` and open it for writing as ``Handles.open`` would: passed through
    when ``headroom`` admits it. Returns (node, passed through)."""
    node = cache.names.create(cache.inodes.root, name, 0o644, 0, 0)
    admitted = cache.files.headroom(node)
    cache.files.open(node, True, False, passthrough=admitted)
    return node, admitted


def persisted(parts, name: bytes, size: int):
    """A file of ``size`` bytes, closed and persisted: cached and evictable."""
    node = write_file(parts.cache, name, b"p" * size)
    parts.cache.files.release(node, True)
    parts.drain()
    assert node.content is not None and not node.dirty
    return node


def test_every_open_writer_passed_through_keeps_its_reservation(parts):
    cache = parts.cache
    writers = [open_writer(cache, b"w%d" % i) for i in range(LIMIT // RESERVE + 1)]
    assert [admitted for _, admitted in writers] == [True] * (LIMIT // RESERVE) + [False]
    first, _ = writers[0]
    cache.files.release(first, True, passthrough=True)      # one writer passed through closes
    _, again = open_writer(cache, b"late")
    assert again, "the room a closed writer kept is free for the next one"
    _, refused = open_writer(cache, b"later")
    assert not refused


def test_persisted_files_count_as_room_and_are_not_evicted_for_a_reservation(parts):
    cache, store = parts.cache, parts.store
    old = [persisted(parts, b"p%d" % i, 16 * BS) for i in range(3)]     # 48 of 64 blocks
    assert store.free_bytes() == LIMIT - 48 * BS
    _, first = open_writer(cache, b"w0")        # 16 blocks free: fits
    _, second = open_writer(cache, b"w1")       # 32 wanted, 16 free + 48 persisted
    assert first and second
    assert all(n.content is not None for n in old), "a reservation evicted nothing"
    _, third = open_writer(cache, b"w2")
    _, fourth = open_writer(cache, b"w3")
    _, fifth = open_writer(cache, b"w4")        # 80 blocks wanted: more than free + persisted
    assert (third, fourth, fifth) == (True, True, False)


def test_a_pinned_file_is_no_room(parts):
    cache = parts.cache
    held = persisted(parts, b"held", 48 * BS)
    cache.files.open(held, False, False, passthrough=True)        # the kernel reads it
    _, first = open_writer(cache, b"w0")
    _, second = open_writer(cache, b"w1")       # only 16 blocks free, the rest pinned
    assert (first, second) == (True, False)
    cache.files.release(held, False, passthrough=True)


@pytest.mark.skipif(not memory_files(), reason="the kernel writes for a writer only with memory "
                                                "files (the passthrough path's store)")
def test_trim_evicts_persisted_files_oldest_first_until_the_cache_is_within_its_size(parts):
    cache, store = parts.cache, parts.store
    old = [persisted(parts, b"p%d" % i, 16 * BS) for i in range(3)]     # 48 blocks, evictable
    writer, admitted = open_writer(cache, b"w")
    assert admitted
    os.pwrite(store._fd(writer.content), b"k" * (40 * BS), 0)     # the kernel writes 40 blocks
    cache.files.sync_content(writer)                              # as Handles counts them
    assert store.used == 88 * BS > LIMIT
    cache.files.trim()
    assert store.used <= LIMIT
    assert [n.content is None for n in old] == [True, True, False], "oldest first, no more"
    assert writer.content is not None and writer.size == 40 * BS
    cache.files.release(writer, True, passthrough=True)
    parts.drain()
    assert (parts.back / "w").read_bytes() == b"k" * (40 * BS)


@pytest.mark.skipif(not memory_files(), reason="the kernel writes for a writer only with memory "
                                                "files (the passthrough path's store)")
def test_no_writer_is_passed_through_while_the_cache_is_over_its_size(parts):
    """A writer passed through wrote past its reservation: until the cache is back within its
    size no new writer is passed through, even where persisted files would count as room for
    its reservation, and the status document and the health rule say so."""
    from acpfs.daemon import health
    cache, store = parts.cache, parts.store
    old = [persisted(parts, b"p%d" % i, 16 * BS) for i in range(3)]     # 48 blocks, evictable
    writer, admitted = open_writer(cache, b"w")
    assert admitted
    os.pwrite(store._fd(writer.content), b"k" * (40 * BS), 0)     # 24 blocks past its room
    cache.files.sync_content(writer)                              # counted; not trimmed yet
    status = {**status_of(store), **cache.files.status()}
    assert (status["over_limit_bytes"], status["writers_passed_through"]) == (24 * BS, 1)
    _, late = open_writer(cache, b"late")
    assert not late, "over its size: the persisted files are the room it must get back to"
    doc = {"flusher_alive": True, "errors": [], "cache": status}
    state, why = health.health(doc, None)
    assert state == health.DEGRADED and "over its size by 96.0 KiB" in why[0], why
    cache.files.trim()
    assert status_of(store)["over_limit_bytes"] == 0 and old[2].content is not None
    assert health.health({**doc, "cache": status_of(store)}, None) == (health.HEALTHY, [])
    _, again = open_writer(cache, b"again")
    assert again, "back within its size, writers are passed through again"
    cache.files.release(writer, True, passthrough=True)
    parts.drain()
    assert (parts.back / "w").read_bytes() == b"k" * (40 * BS)
