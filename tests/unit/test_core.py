"""``acpfs.core.requests.Core`` under trio without FUSE: the filesystem's requests, their errors, statfs
on a hung backing, preload, and the FUSE adapter's one error mapping (``fs.errno_of``)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
import types

import pytest
import trio

import acpfs.core.requests
from acpfs.core import control
from harness import BS
from triocore import CALLER, ROOT, close, create, drain, pattern, read, run, write

BLOCKS = 16
CACHE = BLOCKS * BS


@pytest.fixture
def h(make_core):
    return make_core(blocks=BLOCKS)


@pytest.fixture
def seeded(tmp_path, make_core):
    """A harness whose backing already holds files (listed when the cache starts)."""
    def make(files: dict[str, bytes], **kw):
        back = tmp_path / "s" / "back"
        back.mkdir(parents=True)
        for name, data in files.items():
            (back / name).parent.mkdir(parents=True, exist_ok=True)
            (back / name).write_bytes(data)
        return make_core("s", blocks=BLOCKS, **kw)
    return make


async def raises(code: int, fn, *args, **kw) -> OSError:
    """Await ``fn(*args)`` (or call it) and check it fails with ``code`` (an OSError: FsError
    or one from the backing, what ``fs.errno_of`` maps)."""
    with pytest.raises(OSError) as info:
        result = fn(*args, **kw)
        if hasattr(result, "__await__"):
            await result
    assert info.value.errno == code, info.value
    return info.value


# -- the namespace and file content -----------------------------------------------------------

def test_create_write_release_read_lands_in_the_backing(h):
    data = pattern(3 * BS + 100)

    async def test(core):
        fh, node = await create(core, b"f", mode=0o666)
        assert stat.S_IMODE(node.mode) == 0o644                  # the caller's umask
        assert core.handles.write_now(fh, 0, memoryview(data[:BS])) == BS  # the fast path
        await write(core, fh, data[BS:], off=BS)
        assert await read(core, fh, len(data) + 10) == data
        assert (await core.getxattr(node.ino, control.STATE)) == b"dirty"
        await close(core, fh)
        await drain(h)
        assert (await core.getxattr(node.ino, control.STATE)) == b"persisted"
        seq = json.loads(await core.getxattr(ROOT, control.SEQ))
        assert seq == {"seq": h.cache.oplog.seq, "open_dirty": 0}
        assert (await core.lookup(ROOT, b"f")) is node
        fr, direct, _ = await core.handles.open(node.ino, os.O_RDONLY)
        assert await read(core, fr, 100, off=BS) == data[BS:BS + 100]
        await core.handles.release(fr)
    run(h, test)
    assert (h.back / "f").read_bytes() == data
    assert stat.S_IMODE(os.stat(h.back / "f").st_mode) == 0o644


def test_namespace_operations_reach_the_backing_in_order(h):
    async def test(core):
        d = await core.mkdir(ROOT, b"d", 0o777, CALLER)
        assert stat.S_IMODE(d.mode) == 0o755
        fh, f = await create(core, b"f", parent=d.ino)
        await write(core, fh, b"hello")
        await close(core, fh)
        await core.symlink(ROOT, b"l", b"d/g", CALLER)
        await core.rename(d.ino, b"f", d.ino, b"g", noreplace=False)
        assert core.readlink((await core.lookup(ROOT, b"l")).ino) == b"d/g"
        await core.setattr(f.ino, mode=0o600)
        await core.setxattr(f.ino, b"user.tag", b"v1")
        assert await core.listxattr(f.ino) == [b"user.tag"]
        assert await core.getxattr(f.ino, b"user.tag") == b"v1"
        fh2, _ = await create(core, b"x", parent=d.ino)
        await close(core, fh2)
        await core.unlink(d.ino, b"x")
        e = await core.mkdir(ROOT, b"e", 0o755, CALLER)
        await core.rmdir(ROOT, b"e")
        assert e.nlink == 0
        dh = await core.handles.opendir(d.ino)
        assert [n for n, _ in core.handles.dir_entries(dh)] == [b"g"]
        core.handles.releasedir(dh)
        await drain(h)
    run(h, test)
    assert sorted(os.listdir(h.back)) == ["d", "l"]
    assert os.listdir(h.back / "d") == ["g"]
    assert (h.back / "d" / "g").read_bytes() == b"hello"
    assert stat.S_IMODE(os.stat(h.back / "d" / "g").st_mode) == 0o600
    assert os.getxattr(h.back / "d" / "g", "user.tag") == b"v1"
    assert os.readlink(h.back / "l") == "d/g"


def test_setgid_directories_pass_their_group_on(h):
    caller = types.SimpleNamespace(uid=1000, gid=1000, umask=0)

    async def test(core):
        d = await core.mkdir(ROOT, b"shared", 0o2775, CALLER)
        await core.setattr(d.ino, gid=500)
        sub = await core.mkdir(d.ino, b"sub", 0o755, caller)
        assert sub.gid == 500 and sub.mode & stat.S_ISGID
        _, f, _ = await core.create(d.ino, b"f", 0o644, os.O_WRONLY, caller)
        assert (f.uid, f.gid) == (1000, 500)
        plain = await core.mkdir(ROOT, b"plain", 0o755, caller)
        assert plain.gid == 1000 and not plain.mode & stat.S_ISGID
    run(h, test)


def test_reads_answered_at_once_are_the_bytes_of_the_version_opened(seeded):
    """``Handles.read_now`` (core/readnow.py): a file the cache does not hold is read from its
    backing file's page cache at once, the version the open holds, short only at its end;
    where the page cache does not hold a range, or the backing is not local, None (the
    coroutine and a worker thread take the READ)."""
    size = 3 * (1 << 20) + 77
    old = pattern(size, seed=5)
    h = seeded({"c.bin": old})

    async def test(core):
        node = await core.lookup(ROOT, b"c.bin")
        fh, _, _ = await core.handles.open(node.ino, os.O_RDONLY)
        try:
            assert core.loader.calls.fstype is not None   # the unit tier's backing is local
            with open(h.back / "c.bin", "rb") as f:
                f.read()   # into the page cache
            for off, n in ((0, 1 << 20), (BS + 3, 200_000), (size - 77, 1 << 20), (size, 4096)):
                assert bytes(core.handles.read_now(fh, off, n)) == old[off:off + n], (off, n)
            os.replace(h.back / "c.bin", h.back / "gone")   # another program replaces it...
            (h.back / "c.bin").write_bytes(b"new")
            assert bytes(core.handles.read_now(fh, 0, 10)) == old[:10]   # ...the version opened
            # Back on the disk only. RWF_NOWAIT still starts the readahead of what it asked
            # for, and a fast disk may finish it before the read looks again: such a read
            # answers, and must answer the right bytes; one of a few must find the disk.
            fd = os.open(h.back / "gone", os.O_RDONLY)
            os.fsync(fd)
            answers = []
            for _ in range(50):
                # the readahead the last read started ends first: pages under I/O are not
                # dropped (a CI run found all 20 reads of the range answered)
                time.sleep(0.02)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                got = core.handles.read_now(fh, BS, 2 * BS)
                answers.append(None if got is None else bytes(got))
                if got is None:
                    break
            os.close(fd)
            assert None in answers
            assert all(a == old[BS:3 * BS] for a in answers if a is not None)
            assert await read(core, fh, 2 * BS, off=BS) == old[BS:3 * BS]   # in a worker thread
            core.loader.calls.fstype = None   # as over NFS: never on the event loop
            assert core.handles.read_now(fh, 0, 10) is None
        finally:
            await core.handles.release(fh)
    run(h, test)


def test_a_reader_of_an_uncached_file_reads_the_backing_and_keeps_its_version(seeded):
    old = pattern(5 * BS, seed=3)
    h = seeded({"ckpt": old, "sub/deep": b"deep"})

    async def test(core):
        node = await core.lookup(ROOT, b"ckpt")
        assert node.content is None
        fr, _, _ = await core.handles.open(node.ino, os.O_RDONLY)
        assert await read(core, fr, 2 * BS, off=BS) == old[BS:3 * BS]
        assert node.content is None                               # not copied into the cache
        await core.unlink(ROOT, b"ckpt")                         # deleted meanwhile...
        await drain(h)
        assert not (h.back / "ckpt").exists()
        assert await read(core, fr, 10) == old[:10]              # ...the reader still has it
        await core.handles.release(fr)
        sub = await core.lookup(ROOT, b"sub")                    # loaded on first use
        deep = await core.lookup(sub.ino, b"deep")
        fd, _, _ = await core.handles.open(deep.ino, os.O_RDONLY)
        assert await read(core, fd, 100) == b"deep"
        await core.handles.release(fd)
    run(h, test)


def test_opening_for_writing_copies_the_backing_version_in(seeded):
    old = pattern(3 * BS, seed=4)
    h = seeded({"f": old})

    async def test(core):
        node = await core.lookup(ROOT, b"f")
        fh, direct, _ = await core.handles.open(node.ino, os.O_RDWR)
        # writers get direct_io only where the kernel keeps shared mmap of such files
        assert not direct and node.content is not None and h.store.used == 3 * BS
        core.handles.direct_io_mmap = lambda: True
        # a read-write open has the page cache, and every open beside it shares it
        fh2, direct, _ = await core.handles.open(node.ino, os.O_WRONLY)
        assert not direct and core.handles.handle(fh2).page_cache
        await close(core, fh2)
        await write(core, fh, b"NEW", off=BS)
        await close(core, fh)
        await drain(h)
        assert not core.handles.page_cached
        ft, direct, _ = await core.handles.open(node.ino, os.O_WRONLY | os.O_TRUNC)
        assert direct   # write-only, with nothing else open: direct_io
        assert node.size == 0
        await write(core, ft, b"short")
        await close(core, ft)
        await drain(h)
    run(h, test)
    assert (h.back / "f").read_bytes() == b"short"


def test_fsync_backing_waits_until_the_file_is_in_the_backing(h):
    async def test(core):
        fh, node = await create(core, b"f")
        await write(core, fh, b"durable")
        hang = h.backing.inject("publish", hang=True)
        async with trio.open_nursery() as n:
            done = trio.Event()

            async def fsync():
                await core.handles.fsync(fh)
                done.set()
            n.start_soon(fsync)
            await trio.to_thread.run_sync(hang.entered.wait, 5)
            await trio.sleep(0.05)
            assert not done.is_set()                              # waits for the backing
            hang.release()
        assert (h.back / "f").read_bytes() == b"durable"          # still open: yet durable
        await write(core, fh, b"!", off=7)
        await close(core, fh)
        await core.fsyncdir()
        assert (h.back / "f").read_bytes() == b"durable!"
    run(h, test, fsync_backing=True)


def test_fsync_memory_returns_at_once(h):
    async def test(core):
        fh, _ = await create(core, b"f")
        await write(core, fh, b"x")
        hang = h.backing.inject(hang=True)
        t = time.monotonic()
        await core.handles.fsync(fh)
        await core.fsyncdir()
        assert time.monotonic() - t < 0.1
        hang.release()
        await close(core, fh)
    run(h, test)


# -- statfs -------------------------------------------------------------------------------------

def test_statfs_answers_from_memory_when_the_backing_hangs(h, monkeypatch):
    monkeypatch.setattr(acpfs.core.requests, "STATFS_WAIT", 0.3)

    async def test(core):
        first = await core.statfs()
        assert first.f_bsize == os.statvfs(h.back).f_bsize
        hang = h.backing.inject("statvfs", hang=True)
        calls = lambda: sum(1 for m, _ in h.backing.calls if m == "statvfs")   # noqa: E731
        before = calls()
        for _ in range(2):        # the second call does not start another statvfs
            t = time.monotonic()
            st = await core.statfs()
            assert 0.25 < time.monotonic() - t < 1.0
            assert st == first
            assert calls() == before + 1
        hang.release()
        for _ in range(100):
            if core._statfs_call is None:
                break
            await trio.sleep(0.01)
        t = time.monotonic()
        await core.statfs()
        assert time.monotonic() - t < 0.25
        assert calls() == before + 2
    run(h, test)


def test_statfs_of_a_failing_backing_gives_the_last_answer(h, caplog):
    async def test(core):
        first = await core.statfs()
        h.backing.inject("statvfs", errno=errno.EIO)
        t = time.monotonic()
        assert await core.statfs() == first
        assert time.monotonic() - t < 1.0
    run(h, test)
    assert any("statvfs of the backing failed" in r.getMessage() for r in caplog.records)


# -- preload ---------------------------------------------------------------------------------------

def test_preload(seeded):
    small = pattern(3 * BS + 5, seed=5)
    mid = pattern(10 * BS, seed=6)
    h = seeded({"small": small, "mid": mid, "big": bytes(CACHE + 1), "d/x": b""})

    async def test(core):
        s = await core.lookup(ROOT, b"small")
        answer = json.loads(await core.getxattr(s.ino, control.PRELOAD))
        assert answer == {"size": len(small), "cached": True}
        assert s.content is not None and h.store.used == 4 * BS
        assert bytes(h.cache.files.read(s, 0, CACHE)) == small
        assert json.loads(await core.handles.fetch.preload(s)) == answer        # again: nothing to do
        assert h.store.used == 4 * BS

        await raises(errno.EFBIG, core.handles.fetch.preload, await core.lookup(ROOT, b"big"))
        await raises(errno.EINVAL, core.handles.fetch.preload, await core.lookup(ROOT, b"d"))

        fh, w = await create(core, b"w")                           # 8 blocks dirty, open
        await write(core, fh, b"w" * (8 * BS))
        m = await core.lookup(ROOT, b"mid")
        t = time.monotonic()
        await raises(errno.ENOSPC, core.handles.fetch.preload, m)                # 4 + 8 + 10 > 16
        assert time.monotonic() - t < 0.2                          # never waits for the flusher
        assert m.content is None and h.store.used <= 12 * BS
        await close(core, fh)
        await drain(h)                                             # w is persisted: evictable
        answer = json.loads(await core.handles.fetch.preload(m))
        assert answer == {"size": len(mid), "cached": True}
        fr, _, _ = await core.handles.open(m.ino, os.O_RDONLY)
        assert await read(core, fr, CACHE) == mid                 # from the cache
        await core.handles.release(fr)
        assert w.content is None or s.content is None                # something was evicted
    run(h, test)


def test_preload_of_a_staged_file_reports_not_cached(h):
    async def test(core):
        fh, node = await create(core, b"big")
        await write(core, fh, pattern(CACHE + BS))                 # written through
        assert node.staged is not None
        assert json.loads(await core.handles.fetch.preload(node)) == {"size": CACHE + BS, "cached": False}
        await close(core, fh)
        await drain(h)
    run(h, test)


# -- errors ----------------------------------------------------------------------------------

def test_errors_of_requests(h):
    async def test(core):
        await raises(errno.ENOENT, core.node, 999)
        await raises(errno.EBADF, core.handles.handle, 999)
        await raises(errno.EBADF, core.handles.read, 999, 0, 10)
        await raises(errno.EBADF, core.handles.write, 999, 0, b"x")
        await raises(errno.EBADF, core.handles.release, 999)
        await raises(errno.EBADF, core.handles.dir_entries, 999)
        await raises(errno.ENOENT, core.getxattr, 999, b"user.x")
        await raises(errno.ENOENT, core.lookup, ROOT, b"missing")
        fh, f = await create(core, b"f")
        await raises(errno.EEXIST, create, core, b"f")
        await raises(errno.EPERM, create, core, b".acpfs-tmp-1-2")   # reserved names
        await raises(errno.EINVAL, core.readlink, f.ino)
        await raises(errno.EISDIR, core.handles.open, ROOT, os.O_RDONLY)
        await raises(errno.ENOTDIR, core.mkdir, f.ino, b"x", 0o755, CALLER)
        await raises(errno.ENOTDIR, core.handles.opendir, f.ino)
        await raises(errno.EINVAL, core.setattr, ROOT, size=0)
        d = await core.mkdir(ROOT, b"d", 0o755, CALLER)
        await core.mkdir(d.ino, b"sub", 0o755, CALLER)
        await raises(errno.ENOTEMPTY, core.rmdir, ROOT, b"d")
        await raises(errno.EISDIR, core.unlink, ROOT, b"d")
        await raises(errno.ENOTDIR, core.rmdir, ROOT, b"f")
        await raises(errno.EEXIST, core.rename, ROOT, b"f", ROOT, b"d", True)
        await raises(errno.EISDIR, core.rename, ROOT, b"f", ROOT, b"d", False)
        await raises(errno.EPERM, core.setxattr, f.ino, control.STATE, b"x")
        await raises(errno.EPERM, core.removexattr, f.ino, control.STATE)
        await raises(errno.ENOTSUP, core.setxattr, f.ino, b"trusted.x", b"v")
        await raises(errno.ENODATA, core.getxattr, f.ino, b"user.none")
        await raises(errno.ENODATA, core.getxattr, f.ino, b"security.selinux")
        await raises(errno.ENODATA, core.getxattr, f.ino, control.STATUS)   # root only
        await raises(errno.ENODATA, core.removexattr, f.ino, b"user.none")
        status = json.loads(await core.getxattr(ROOT, control.STATUS))
        assert status["version"] == control.STATUS_VERSION and status["flusher_alive"]
        await core.handles.release(fh)
        await raises(errno.EBADF, core.handles.release, fh)              # released twice
        await drain(h)
    run(h, test)


def test_a_forgotten_inode_is_enoent(h):
    async def test(core):
        fh, f = await create(core, b"f")
        await close(core, fh)
        await core.unlink(ROOT, b"f")
        f.lookups = 1
        core.forget(f.ino, 1)
        await raises(errno.ENOENT, core.node, f.ino)
        core.forget(12345, 1)                                    # unknown: ignored
        core.forget(ROOT, 1)                                     # the root is never forgotten
        assert core.node(ROOT) is h.cache.inodes.root
        await drain(h)
    run(h, test)


# -- the FUSE adapter's error mapping ----------------------------------------------------------

def test_errno_of_maps_oserrors_and_answers_eio_for_bugs(caplog):
    import pyfuse3

    from acpfs.fuse.operations import errno_of, replies
    from acpfs.node import err
    assert errno_of(OSError(errno.ENOSPC, "full"), "write") == errno.ENOSPC
    assert errno_of(err(errno.EBADF), "read") == errno.EBADF
    assert errno_of(FileNotFoundError(errno.ENOENT, "x"), "lookup") == errno.ENOENT
    assert errno_of(pyfuse3.FUSEError(errno.EACCES), "open") == errno.EACCES
    assert errno_of(OSError("no errno"), "x") == errno.EIO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errno_of(KeyError(7), "getattr") == errno.EIO
    assert errno_of(AssertionError("bug"), "setattr") == errno.EIO
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in bugs] == ["internal error in getattr", "internal error in setattr"]
    assert bugs[0].exc_info is not None and bugs[0].exc_info[0] is KeyError   # with traceback

    @replies
    async def handler(exc):
        raise exc

    async def main():
        for exc, code in ((OSError(errno.EROFS, "ro"), errno.EROFS), (KeyError(1), errno.EIO)):
            with pytest.raises(pyfuse3.FUSEError) as info:
                await handler(exc)
            assert info.value.errno == code
    trio.run(main)


# -- close-to-open against another writer of the backing (docs/semantics.md, section 10) ------

def _replace(path, data: bytes) -> None:
    """Another node publishes a new version: a new file renamed over the name."""
    tmp = path.with_name(path.name + ".other")
    tmp.write_bytes(data)
    os.rename(tmp, path)


def test_an_open_sees_another_writers_version_at_once(seeded):
    """No coherence timeout passes: the open itself compares, and the attributes follow."""
    h = seeded({"f": b"one" * 100})
    forgot = []

    async def test(core):
        core.loader.invalidate_attrs = forgot.append
        node = await core.lookup(ROOT, b"f")
        fh, _, _ = await core.handles.open(node.ino, os.O_RDONLY)
        assert await read(core, fh, 10) == b"oneoneoneo"
        await core.handles.release(fh)
        _replace(h.back / "f", b"three" * 300)
        fh, _, _ = await core.handles.open(node.ino, os.O_RDONLY)
        assert node.size == 1500 and forgot == [node.ino]
        assert await read(core, fh, 2000) == b"three" * 300
        await core.handles.release(fh)
        # a writer's open too: an append lands after the new version
        _replace(h.back / "f", b"four" * 10)
        fa, _, _ = await core.handles.open(node.ino, os.O_WRONLY | os.O_APPEND)
        await write(core, fa, b"+tail", off=3)        # the kernel's offset from an old size
        await close(core, fa)
        await drain(h)
    run(h, test, coherence_timeout=3600.0)
    assert (h.back / "f").read_bytes() == b"four" * 10 + b"+tail"


def test_a_version_replaced_while_open_here_answers_estale_and_moves_the_name(seeded):
    h = seeded({"f": b"old" * 100})

    async def test(core):
        node = await core.lookup(ROOT, b"f")
        old, _, _ = await core.handles.open(node.ino, os.O_RDONLY)
        _replace(h.back / "f", b"new" * 200)
        await raises(errno.ESTALE, core.handles.open, node.ino, os.O_RDONLY)
        fresh = await core.lookup(ROOT, b"f")          # what the kernel does on ESTALE
        assert fresh is not node and fresh.size == 600
        fh, _, _ = await core.handles.open(fresh.ino, os.O_RDONLY)
        assert await read(core, fh, 1000) == b"new" * 200
        assert await read(core, old, 1000) == b"old" * 100   # the old descriptor: its version
        await core.handles.release(fh)
        await core.handles.release(old)
        assert node.ino not in h.cache.inodes.nodes               # dropped at its last close
        # a name removed elsewhere: ESTALE, then the lookup says ENOENT
        os.unlink(h.back / "f")
        await raises(errno.ESTALE, core.handles.open, fresh.ino, os.O_RDONLY)
        await raises(errno.ENOENT, core.lookup, ROOT, b"f")
    run(h, test, coherence_timeout=3600.0)


def test_a_copy_of_another_version_than_checked_is_estale(seeded):
    """The content copied into the cache (for a writer, or preload) is the version the mount
    reports, or nothing: a file replaced between the check and the copy gives ESTALE."""
    h = seeded({"f": b"a" * 100})

    async def test(core):
        node = await core.lookup(ROOT, b"f")
        _replace(h.back / "f", b"b" * 300)               # after the check of the lookup
        await raises(errno.ESTALE, core.handles.fetch.preload, node)
        assert node.content is None and h.store.used == 0 * BS
    run(h, test, coherence_timeout=3600.0)


def test_a_name_the_view_lacks_is_looked_up_and_opendir_relists_a_changed_directory(seeded):
    h = seeded({"d/mine": b"m"})

    async def test(core):
        d = await core.lookup(ROOT, b"d")
        fh = await core.handles.opendir(d.ino)
        assert [n for n, _ in core.handles.dir_entries(fh)] == [b"mine"]
        core.handles.releasedir(fh)
        (h.back / "d" / "theirs").write_bytes(b"t" * 7)
        assert (await core.lookup(d.ino, b"theirs")).size == 7
        (h.back / "d" / "more").write_bytes(b"x")
        os.unlink(h.back / "d" / "mine")
        fh = await core.handles.opendir(d.ino)
        assert sorted(n for n, _ in core.handles.dir_entries(fh)) == [b"more", b"theirs"]
        core.handles.releasedir(fh)
        # this mount's own removal, still queued, is not looked up again
        await core.unlink(d.ino, b"theirs")
        await raises(errno.ENOENT, core.lookup, d.ino, b"theirs")
        await raises(errno.ENOENT, core.lookup, d.ino, b".acpfs-nodes")
    run(h, test, coherence_timeout=3600.0)


def test_a_lookup_met_by_an_opendir_that_found_the_directory_unchanged_still_looks(seeded,
                                                                                   monkeypatch):
    """A lookup takes a listing begun during it as the truth of a missing name, but not an
    opendir that only found the directory's version unchanged meanwhile: that version can
    be an attribute cache's (NFS keeps a directory's attributes for seconds), older than a
    name another node made. Modeled as the race it is: the lookup began (its clock read)
    before the opendir, on both the coroutine path (``find``) and the one answered at once
    (``find_now``)."""
    h = seeded({"d/mine": b"m"})
    versioned = h.backing.versioned_listing
    # the directory's version as a cache on the way may report it: unchanged
    monkeypatch.setattr(h.backing, "versioned_listing",
                        lambda path, unless=None: None if unless is not None
                        else versioned(path, unless))
    real = time.monotonic

    async def test(core):
        d = await core.lookup(ROOT, b"d")
        fh = await core.handles.opendir(d.ino)   # the listing that reads it
        core.handles.releasedir(fh)
        for name in (b"theirs", b"theirs2"):
            await trio.sleep(0.01)
            began = real()                        # a lookup begins ...
            await trio.sleep(0.01)
            (h.back / "d" / name.decode()).write_bytes(b"t" * 7)   # ... another node makes it ...
            d.listed_at = 0.0                     # (past the coherence timeout)
            await core.loader.refreshed(d)        # ... an opendir finds the version unchanged
            assert d.listed_at > began
            clock = iter([began])
            monkeypatch.setattr(acpfs.core.requests.time, "monotonic",
                                lambda: next(clock, None) or real())
            if name == b"theirs":
                node = await core.find(d.ino, name)
            else:
                known, node = core.find_now(d.ino, name)
                assert known
            monkeypatch.setattr(acpfs.core.requests.time, "monotonic", real)
            assert node is not None and node.size == 7, name
    run(h, test, coherence_timeout=3600.0)


def test_a_name_is_answered_missing_for_sure_only_where_the_daemon_knows_it(seeded):
    """``Core.find`` answers None (missing for sure: the FUSE adapter lets the kernel keep
    that, docs/semantics.md section 10) for a name that is neither in the view nor in the
    backing, for this mount's own removal and for an internal name; a lookup the backing
    failed or did not answer in time raises ENOENT instead (never kept). Every name another
    writer made that joins the view, by a lookup or by a listing, is told to the kernel
    notices (``KernelNotices.appeared``: the adapter drops a kept "missing" for it)."""
    from acpfs.node import KernelNotices
    h = seeded({"d/mine": b"m"})
    appeared: list[bytes] = []

    class Notices(KernelNotices):
        def appeared(self, parent_ino: int, name: bytes) -> None:
            appeared.append(name)

    h.cache.coherence.kernel = Notices()

    async def test(core):
        d = await core.lookup(ROOT, b"d")
        core.handles.releasedir(await core.handles.opendir(d.ino))   # loaded: "mine" joined
        assert appeared == [b"mine"]
        appeared.clear()
        await trio.sleep(0.01)                               # past the coherence timeout
        assert await core.find(d.ino, b"nothing") is None
        assert await core.find(ROOT, b".acpfs-nodes") is None
        (h.back / "d" / "later").write_bytes(b"l")
        assert (await core.find(d.ino, b"later")).size == 1
        assert appeared == [b"later"]
        await core.unlink(d.ino, b"later")
        assert await core.find(d.ino, b"later") is None      # its removal, pending or done
        fault = h.backing.inject("stat_entry", errno=errno.EIO)
        await trio.sleep(0.01)
        await raises(errno.ENOENT, core.find, d.ino, b"nothing")
        h.backing.faults.remove(fault)
        core.loader.calls.fstype = None    # as over NFS: checks in threads, which a hang holds
        hang = h.backing.inject("stat_entry", hang=True)
        await trio.sleep(0.01)
        await raises(errno.ENOENT, core.find, d.ino, b"nothing")   # after COHERENCE_WAIT
        hang.release()
        await trio.sleep(0.01)
        assert await core.find(d.ino, b"nothing") is None
        (h.back / "d" / "listed").write_bytes(b"x")
        core.handles.releasedir(await core.handles.opendir(d.ino))
        assert appeared == [b"later", b"listed"]
        # a directory whose mkdir is not in the backing yet (the flusher held): nothing can
        # be in it there, so a name missing from it is missing for sure, not ENOENT for want
        # of a place to look (it was: every probe of a database's journal in a fresh
        # directory reached the daemon while the flusher was behind)
        held = h.backing.inject("mkdir", hang=True)
        new = await core.mkdir(d.ino, b"new", 0o755, CALLER)
        sub = await core.mkdir(new.ino, b"sub", 0o755, CALLER)
        await trio.sleep(0.01)
        assert await core.find(new.ino, b"nothing") is None
        assert await core.find(sub.ino, b"nothing") is None
        held.release()
    run(h, test, coherence_timeout=0.005)


def test_a_lookup_compares_the_name_alone_never_lists_the_directory(seeded):
    """After the coherence timeout a lookup looks at its one name in the backing (an lstat, as
    NFS's LOOKUP): a name another writer made, removed or turned into a directory shows
    right, and no lookup lists the directory again (a cold load's lookups in a large
    directory cost one lstat each); the next opendir lists it."""
    h = seeded({"d/mine": b"m", "d/gone": b"g", "d/kind": b"k"})
    listings = []

    async def test(core):
        coherence = h.cache.coherence
        for name in ("list_backing", "relist_backing"):
            real = getattr(coherence, name)
            setattr(coherence, name, lambda *a, _real=real, _name=name, **k:
                    listings.append(_name) or _real(*a, **k))
        d = await core.lookup(ROOT, b"d")
        fh = await core.handles.opendir(d.ino)
        assert sorted(n for n, _ in core.handles.dir_entries(fh)) == [b"gone", b"kind", b"mine"]
        core.handles.releasedir(fh)
        mine = await core.lookup(d.ino, b"mine")
        listings.clear()
        for i in range(100):
            (h.back / "d" / f"new{i}").write_bytes(b"n" * i)
        os.unlink(h.back / "d" / "gone")
        os.unlink(h.back / "d" / "kind")
        (h.back / "d" / "kind").mkdir()
        await trio.sleep(0.01)                              # past the coherence timeout
        assert (await core.lookup(d.ino, b"new42")).size == 42
        assert await core.lookup(d.ino, b"mine") is mine
        await raises(errno.ENOENT, core.lookup, d.ino, b"gone")
        assert (await core.lookup(d.ino, b"kind")).is_dir
        assert await core.lookup(ROOT, b"d") is d
        assert listings == []
        fh = await core.handles.opendir(d.ino)
        names = {n for n, _ in core.handles.dir_entries(fh)}
        core.handles.releasedir(fh)
        assert listings == ["relist_backing"]
        assert names == {b"mine", b"kind"} | {f"new{i}".encode() for i in range(100)}
    run(h, test, coherence_timeout=0.005)


def test_a_small_directory_is_listed_on_the_event_loop_a_large_one_in_a_thread(seeded):
    """A directory's first listing runs where BackingCalls says when the backing directory is
    at most QUICK_DIR_BYTES (a cold load of step/model.pt lists step on its way), a larger
    one always in a worker thread (a listing of thousands of entries must not stop the
    loop)."""
    import threading

    from acpfs.core.loader import QUICK_DIR_BYTES
    files = {"small/a": b"a", "small/b": b"b"}
    files.update({f"big/{'n' * 60}{i:04d}": b"" for i in range(300)})
    h = seeded(files)
    assert os.stat(h.back / "big").st_size > QUICK_DIR_BYTES >= os.stat(h.back / "small").st_size
    where: dict[str, str] = {}

    async def test(core):
        coherence = h.cache.coherence
        real = coherence.list_backing

        def listing(node):
            where[node.name.decode()] = threading.current_thread().name
            return real(node)
        coherence.list_backing = listing
        me = threading.current_thread().name
        small = await core.lookup(ROOT, b"small")
        assert (await core.lookup(small.ino, b"b")).size == 1
        big = await core.lookup(ROOT, b"big")
        assert (await core.lookup(big.ino, b"n" * 60 + b"0299")).size == 0
        assert where["small"] == me and where["big"] != me, where
    run(h, test)


def test_backing_calls_run_inline_on_a_local_backing_unless_the_flusher_holds_it():
    """core/backcalls.py: on a local backing a lookup's call runs on the event loop; while
    another thread (the flusher) holds position_lock it runs in a worker thread instead,
    never waiting on the event loop; a backing that is not local always uses threads."""
    import threading

    from acpfs.core.backcalls import BackingCalls

    lock = threading.RLock()
    where: list[str] = []

    def call(x: int) -> int:
        with lock:   # as Coherence.stat_name takes it again
            where.append(threading.current_thread().name)
        return x + 1

    async def main() -> None:
        me = threading.current_thread().name
        local = BackingCalls("ext4", lock)
        assert await local.run(call, 1) == 2 and where[-1] == me
        held, release = threading.Event(), threading.Event()

        def flusher() -> None:
            with lock:
                held.set()
                release.wait(10)
        t = threading.Thread(target=flusher)
        t.start()
        held.wait(10)
        ticks: list[float] = []
        got = 0
        try:
            async with trio.open_nursery() as n:
                async def ticker() -> None:
                    while not got:
                        ticks.append(time.monotonic())
                        await trio.sleep(0.01)

                async def releaser() -> None:   # a trio task: it runs only if the loop does
                    await trio.sleep(0.3)
                    release.set()
                n.start_soon(ticker)
                n.start_soon(releaser)
                got = await local.run(call, 2)
        finally:
            release.set()
            t.join()
        assert len(ticks) >= 10, "the event loop kept serving while the call waited for the lock"
        assert got == 3 and where[-1] != me
        assert local.status() == {"where": "inline", "fstype": "ext4", "inline": 1, "threaded": 1}
        remote = BackingCalls(None, lock)
        assert await remote.run(call, 3) == 4 and where[-1] != me
        assert remote.status()["where"] == "threads" and remote.status()["threaded"] == 1
        with trio.CancelScope() as cs:
            cs.cancel()
            await local.run(call, 4)
        assert len(where) == 3, "a cancelled call does not run"

    trio.run(main)
