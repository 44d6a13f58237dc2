"""The control attributes (acpfs/control.py) on a core without a mount: the listing of
pending files, read page by page, for 100,000 files (none may be missing: one attribute value
is at most 64 KiB; the listing used to be cut at 400 files, and failed with E2BIG before
that with long paths)."""

from __future__ import annotations

import errno
import json

import pytest

from acpfs.core import control
from acpfs.core.control import FILES
from acpfs.node import node_path


def read_all(core, trusted=True):
    get = lambda name: control.get(core.flusher, None, core.cache.inodes.root, name, trusted)  # noqa: E731
    raw = get(FILES)
    pages = [raw]
    page = json.loads(raw)
    files = list(page["files"])
    while page["next"]:
        raw = get(page["next"].encode())
        pages.append(raw)
        page = json.loads(raw)
        files.extend(page["files"])
    return files, pages


def test_a_listing_of_100000_pending_files_comes_in_pages_under_64_kib(core):
    cache = core.cache
    dirs = [cache.names.mkdir(cache.inodes.root, b"dir-%03d-" % i + b"d" * 240, 0o755, 0, 0) for i in range(100)]
    names = set()
    for i in range(100_000):
        node = cache.names.create(dirs[i % 100], b"file-%06d-" % i + b"f" * 200, 0o644, 0, 0)
        cache.files.open(node, True, False)                 # open for writing: dirty
        names.add(node_path(node))
    files, pages = read_all(core)
    assert max(len(p) for p in pages) <= 65536 and len(pages) > 300
    paths = [f["path"] for f in files]
    assert len(paths) == 100_000 and set(paths) == names and paths == sorted(paths)
    assert all(f["state"] == "dirty" for f in files)
    assert json.loads(pages[0])["total"] == 100_000


def test_the_pages_of_one_listing_agree_while_the_mount_changes(core):
    cache = core.cache
    for i in range(3000):
        node = cache.names.create(cache.inodes.root, b"f%05d-" % i + b"x" * 100, 0o644, 0, 0)
        cache.files.open(node, True, False)
    get = lambda name: control.get(core.flusher, None, cache.inodes.root, name)   # noqa: E731
    first = json.loads(get(FILES))
    for i in range(500):                              # more files between two pages
        node = cache.names.create(cache.inodes.root, b"a%05d" % i, 0o644, 0, 0)
        cache.files.open(node, True, False)
    files, page = list(first["files"]), first
    while page["next"]:
        page = json.loads(get(page["next"].encode()))
        files.extend(page["files"])
    assert len(files) == 3000 and len({f["path"] for f in files}) == 3000
    assert len(read_all(core)[0]) == 3500            # a new listing sees them


def test_a_gone_listing_says_so_and_other_users_get_no_page(core):
    cache = core.cache
    node = cache.names.create(cache.inodes.root, b"f", 0o644, 0, 0)
    cache.files.open(node, True, False)
    with pytest.raises(OSError) as e:
        control.get(core.flusher, None, cache.inodes.root, FILES + b".0badcafe.10")
    assert e.value.errno == errno.EAGAIN
    one = json.loads(control.get(core.flusher, None, cache.inodes.root, FILES))
    for name in (FILES, FILES + b".00000000.0"):
        with pytest.raises(OSError) as e:
            control.get(core.flusher, None, cache.inodes.root, name, trusted=False)
        assert e.value.errno == errno.EACCES
    assert one["total"] == 1 and one["next"] is None
    for _ in range(control.Listings.MAX + 2):         # only the newest few are kept
        control.get(core.flusher, None, cache.inodes.root, FILES)
    assert len(control.listings._kept) <= control.Listings.MAX
