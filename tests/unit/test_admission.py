"""Which writers the kernel may write for (passthrough), without a mount: ``Admission.admit``
passes a writer through only when its size is known (the file's when reopened, its base
name's last version's otherwise) or, on a store on disk, with a fixed reservation; only
while the cache has room for its reservation and those of every writer passed through still
open, counting persisted files as room without evicting them for a guess; and never while
the cache is over its size. ``Files.trim`` evicts persisted files once written bytes push
the cache past its size. Each test fails on a cache that admits every writer or never trims."""

from __future__ import annotations

import logging
import os

import pytest

from acpfs.cache import admission as admission_module
from acpfs.store.api import CacheFull, status_of

from harness import BS, memory_files, write_file

RESERVE = 16 * BS            # what a writer of unknown size reserves on a disk store, here
LIMIT = 64 * BS              # the harness's cache: 64 blocks


@pytest.fixture(params=["ram", "disk"])
def parts(core, monkeypatch, request):
    """The harness's parts, its store taken for one in RAM (tmpfs) or on a disk."""
    monkeypatch.setattr(admission_module, "PASS_WRITER_RESERVE", RESERVE)
    monkeypatch.setattr(core.store, "in_ram", request.param == "ram", raising=False)
    assert core.store.limit == LIMIT
    return core


def open_writer(cache, name: bytes, parent=None, trunc: bool = False, append: bool = False):
    """Create ``name`` (or open it, where it is) for writing as ``Handles.open`` would:
    passed through when the admission admits it. Returns (node, passed through)."""
    node = (parent or cache.inodes.root).children.get(name)
    if node is None:
        node = cache.names.create(parent or cache.inodes.root, name, 0o644, 0, 0)
    elif not node.writers:
        cache.admission.learn(node)
    admitted = cache.admission.admit(node, trunc, append)
    cache.files.open(node, True, trunc, append, passthrough=admitted)
    return node, admitted


def close_writer(cache, node, passed: bool) -> None:
    cache.admission.learn(node)
    cache.files.release(node, True, passthrough=passed)


def known(parts, names: list[bytes], size: int) -> None:
    """Files of these base names, ``size`` bytes each, closed in another directory (the
    last step's): their sizes are known; the files are then removed, leaving the cache as
    it was."""
    cache = parts.cache
    used = parts.store.used
    step = cache.names.mkdir(cache.inodes.root, b"step-%d" % len(cache.inodes.root.children),
                             0o755, 0, 0)
    for name in names:
        node = write_file(cache, name, b"s" * size, parent=step)
        close_writer(cache, node, False)
        cache.names.unlink(step, name)
        parts.drain()
    assert parts.store.used == used


def persisted(parts, name: bytes, size: int):
    """A file of ``size`` bytes, closed and persisted: cached and evictable."""
    node = write_file(parts.cache, name, b"p" * size)
    close_writer(parts.cache, node, False)
    parts.drain()
    assert node.content is not None and not node.dirty
    return node


def test_a_writer_of_unknown_size_takes_the_daemons_path_on_a_store_in_ram(parts):
    cache = parts.cache
    writers = [open_writer(cache, b"w%d" % i) for i in range(LIMIT // RESERVE + 1)]
    admitted = [passed for _, passed in writers]
    if parts.store.in_ram:
        assert admitted == [False] * len(writers), "a size not known is not passed through"
        assert cache.admission.status()["unknown_size"] == len(writers)
    else:
        assert admitted == [True] * (LIMIT // RESERVE) + [False], "each reserves RESERVE"
        assert cache.admission.status()["no_room"] == 1
    for node, passed in writers:
        close_writer(cache, node, passed)


def test_every_open_writer_passed_through_keeps_the_size_its_name_had(parts):
    cache = parts.cache
    names = [b"rank%d.pt" % i for i in range(5)]
    known(parts, names, 16 * BS)
    step = cache.names.mkdir(cache.inodes.root, b"next", 0o755, 0, 0)
    writers = [open_writer(cache, name, step) for name in names]
    assert [passed for _, passed in writers] == [True] * 4 + [False], \
        "4 x 16 blocks fill the 64 of the cache: the fifth has no room"
    assert cache.admission.status() == {"passed_through": 4, "unknown_size": 0, "no_room": 1,
                                        "over_size": 0}
    first, _ = writers[0]
    cache.files.write(first, 0, b"r" * (16 * BS))      # what it was admitted for
    close_writer(cache, first, True)                   # one writer passed through closes
    parts.drain()
    late, again = open_writer(cache, names[0], cache.names.mkdir(step, b"d", 0o755, 0, 0))
    assert again, "the room a closed writer kept is free for the next one"
    close_writer(cache, late, True)
    for node, passed in writers[1:]:
        close_writer(cache, node, passed)


@pytest.mark.skipif(not memory_files(), reason="the kernel writes for a writer only with memory "
                                                "files (the passthrough path's store)")
def test_the_daemons_own_writes_leave_the_room_promised_to_writers_passed_through(parts):
    cache, store = parts.cache, parts.store
    known(parts, [b"ckpt"], 32 * BS)
    writer, admitted = open_writer(cache, b"ckpt")
    assert admitted
    other = write_file(cache, b"new", b"d" * (16 * BS))       # the daemon's path: 16 fit
    with pytest.raises(CacheFull):
        cache.files.write(other, 16 * BS, b"d" * (17 * BS))    # 33 of the 32 not promised
    os.pwrite(store._fd(writer.content), b"k" * (32 * BS), 0)  # the kernel writes its 32
    cache.files.sync_content(writer)
    assert store.used <= LIMIT, "what was promised was there"
    cache.files.write(other, 16 * BS, b"d" * (16 * BS))        # the rest of the cache
    assert store.used == LIMIT
    close_writer(cache, writer, True)
    close_writer(cache, other, False)
    parts.drain()
    assert (parts.back / "ckpt").read_bytes() == b"k" * (32 * BS)


def test_an_appender_has_no_known_size(parts):
    """A log reopened with O_APPEND grows by what it appends, whatever it held: on a store
    in RAM it takes the daemon's path (which writes it through when the cache is full)."""
    cache = parts.cache
    log = write_file(cache, b"run.log", b"l" * (4 * BS))
    close_writer(cache, log, False)
    parts.drain()
    node, passed = open_writer(cache, b"run.log", append=True)
    assert passed == (not parts.store.in_ram)
    cache.files.release(node, True, append=True, passthrough=passed)


@pytest.mark.skipif(not memory_files(), reason="the kernel writes for a writer only with memory "
                                                "files (the passthrough path's store)")
def test_a_reopened_file_reserves_its_size_and_a_truncated_one_its_last_size(parts):
    cache = parts.cache
    big = write_file(cache, b"big", b"b" * (24 * BS))
    close_writer(cache, big, False)
    parts.drain()
    _, reopened = open_writer(cache, b"big")          # 24 blocks held: reserves nothing more
    assert reopened, "40 blocks free: room for it to grow by RESERVE"
    assert cache.admission.owed() == 0, "a reopened file is owed nothing: it starves nobody"
    other = write_file(cache, b"other", b"o" * (30 * BS))
    close_writer(cache, other, False)
    parts.drain()
    cache.files.release(big, True, passthrough=True)
    _, truncated = open_writer(cache, b"other", trunc=True)
    assert truncated and cache.admission.reserved[other.ino] == 30 * BS


def test_persisted_files_are_room_evicted_for_a_reservation_oldest_first_and_no_more(parts):
    cache, store = parts.cache, parts.store
    old = [persisted(parts, b"p%d" % i, 16 * BS) for i in range(3)]     # 48 of 64 blocks
    assert store.free_bytes() == LIMIT - 48 * BS
    known(parts, [b"w%d" % i for i in range(5)], 16 * BS)
    _, first = open_writer(cache, b"w0")        # 16 blocks free: fits
    assert first and all(n.content is not None for n in old), "nothing evicted for it"
    _, second = open_writer(cache, b"w1")       # 32 wanted, 16 free + 48 persisted
    assert second
    assert [n.content is None for n in old] == [True, False, False], "oldest first, no more"
    assert store.free_bytes() >= 32 * BS, "the reservations fit in the cache's size at once"
    _, third = open_writer(cache, b"w2")
    _, fourth = open_writer(cache, b"w3")
    assert (third, fourth) == (True, True) and all(n.content is None for n in old)
    _, fifth = open_writer(cache, b"w4")        # 80 blocks wanted: more than the cache
    assert not fifth
    assert cache.admission.status()["no_room"] == 1


def test_room_looks_at_persisted_files_only_while_free_space_is_short(parts, monkeypatch):
    """A create in a cache that holds many persisted files must not look at each of them
    (with 20,000 files cached, creates fell from about 1,200 to 40 per second,
    docs/benchmarks.md): ``Files.has_room`` sums evictable files only where the free bytes
    are not enough, and only until they are."""
    cache, store, files = parts.cache, parts.store, parts.cache.files
    old = [persisted(parts, b"p%d" % i, 4 * BS) for i in range(12)]     # 48 of 64 blocks
    looked: list = []
    evictable = files.evictable
    monkeypatch.setattr(files, "evictable", lambda n: looked.append(n) or evictable(n))
    assert files.has_room(16 * BS) and looked == []
    assert files.has_room(24 * BS) and len(looked) == 2, "8 blocks short: the two oldest"
    looked.clear()
    assert files.has_room(64 * BS) and len(looked) == 12
    looked.clear()
    assert not files.has_room(64 * BS, skip=old[0]) and len(looked) == 11
    assert not files.has_room(65 * BS)
    assert all(n.content is not None for n in old), "asking evicts nothing"
    # and what the admission decides from it, without looking at any of them while it fits
    known(parts, [b"w0"], 8 * BS)
    looked.clear()
    _, passed = open_writer(cache, b"w0")
    assert passed and looked == []


def test_a_pinned_file_is_no_room(parts):
    cache = parts.cache
    known(parts, [b"w0", b"w1"], 16 * BS)
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
    known(parts, [b"w", b"late", b"again"], 16 * BS)
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
    close_writer(cache, writer, True)
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
    known(parts, [b"w", b"late", b"again"], 16 * BS)
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
    close_writer(cache, writer, True)
    parts.drain()
    assert (parts.back / "w").read_bytes() == b"k" * (40 * BS)


@pytest.mark.skipif(not memory_files(), reason="the kernel writes for a writer only with memory "
                                                "files (the passthrough path's store)")
def test_a_writer_that_grows_far_past_its_names_size_is_said_and_its_new_size_learned(parts,
                                                                                        caplog):
    cache, store = parts.cache, parts.store
    known(parts, [b"ckpt"], 8 * BS)
    writer, admitted = open_writer(cache, b"ckpt")
    assert admitted and cache.admission.reserved[writer.ino] == 8 * BS
    os.pwrite(store._fd(writer.content), b"g" * (8 * BS + admission_module.GROWTH // 2), 0)
    cache.files.sync_content(writer)
    with caplog.at_level(logging.WARNING, "acpfs.cache.admission"):
        cache.admission.check_growth()
    assert not caplog.records, "within GROWTH of its reservation: nothing to say"
    grown = 8 * BS + admission_module.GROWTH + BS
    os.pwrite(store._fd(writer.content), b"g" * grown, 0)
    cache.files.sync_content(writer)
    with caplog.at_level(logging.WARNING, "acpfs.cache.admission"):
        cache.admission.check_growth()
        cache.admission.check_growth()
    said = [r.getMessage() for r in caplog.records]
    if store.in_ram:
        assert len(said) == 1 and said[0].startswith("ckpt: written with passthrough to "), said
    else:
        assert not said, "on a disk store the page cache bounds the RAM: nothing to warn of"
    assert cache.admission.sizes[b"ckpt"] == grown
    close_writer(cache, writer, True)
    parts.drain()
    cache.files.trim()


def test_the_sizes_kept_are_the_newest_names(parts, monkeypatch):
    monkeypatch.setattr(admission_module, "NAMES", 3)
    known(parts, [b"a", b"b", b"c", b"d"], 4 * BS)
    assert list(parts.cache.admission.sizes) == [b"b", b"c", b"d"]
    _, passed = open_writer(parts.cache, b"a")
    assert passed == (not parts.store.in_ram), "a forgotten name is a size not known"
