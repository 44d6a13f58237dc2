"""Close-to-open coherence as NFS gives it, with no wait past --coherence-timeout
(docs/semantics.md, section 10): once a writer node's change is in the backing (its
`acpfs sync` returned), another node's next open sees that version, whole, its next listing
(opendir) sees the names, and a name it looks up that it has not seen is looked for in the
backing. Writes through an open revalidate first, so an append lands after another node's
content instead of cutting it.

Each test mounts its nodes with a coherence timeout of an hour (``nodes``) and reads at once
after the writer's sync: nothing a node's daemon knows times out during a test (the kernel's
own caches still expire after 5 s, but the daemon then answers from what it knows), so only
the checks at open, opendir and the lookup of a missing name can make them pass; neither
waiting nor a short timeout would.
"""

from __future__ import annotations

import os
import stat
import time

from conftest import content, digest

COHERENCE_TIMEOUT = 3600   # s: longer than any test, so what a node knows never times out


def nodes(make_nodes) -> list:
    """Two nodes over one backing, each trusting what it knows for COHERENCE_TIMEOUT."""
    made = make_nodes(2, extra=("--coherence-timeout", str(COHERENCE_TIMEOUT)))
    for node in made:
        assert node.status()["options"]["coherence_timeout_s"] == COHERENCE_TIMEOUT
    return made


def version(i: int) -> tuple[str, int]:
    """The i-th version of the rewritten file: 1 MiB and 3 MiB in turn."""
    return f"v{i}", (1 << 15) * (1 if i % 2 == 0 else 3)


def classify(got: str, versions: list[str], i: int) -> str:
    if got == versions[i]:
        return "current"
    if got in versions[:i]:
        return "stale"
    return "mixed"


def test_every_read_after_the_writers_sync_is_that_whole_version(make_nodes, workers):
    """A file another node rewrites (sizes alternating 1 and 3 MiB) and syncs: each open on
    the other node right after reads exactly that version. Two readers: one that only read
    the file (its content comes from the backing on demand) and one that wrote it before
    (its old content is cached there)."""
    a, b = nodes(make_nodes)
    wa, wb = workers(a, b)
    tag, units = version(0)
    wb.do("write", "read.bin", tag, units)
    wa.do("write", "cached.bin", "mine", 1 << 15)
    a.sync()
    b.sync()
    versions = [digest(content(*version(i))) for i in range(21)]
    assert wa.do("sha", "read.bin") == versions[0]
    assert wb.do("sha", "cached.bin") == digest(content("mine", 1 << 15))
    seen: dict[str, list[str]] = {"read.bin": [], "cached.bin": []}
    for i in range(1, 21):
        tag, units = version(i)
        wb.do("write", "read.bin", tag, units)
        wb.do("write", "cached.bin", tag, units)
        b.sync()
        for name in seen:
            seen[name].append(classify(wa.do("sha", name), versions, i))
    for name, kinds in seen.items():
        assert kinds.count("mixed") == 0, f"{name}: reads mixing two versions: {kinds}"
        assert kinds.count("stale") == 0, f"{name}: stale reads: {kinds}"


def test_append_after_another_nodes_sync_keeps_its_bytes(make_nodes, workers):
    """Node B grows a file A had read from 1 to 3 MiB and syncs; A appends 16 bytes at once
    (open mode "ab"): the backing holds B's 3 MiB and then A's bytes."""
    a, b = nodes(make_nodes)
    wa, wb = workers(a, b)
    wb.do("write", "log.bin", "one", 1 << 15)
    b.sync()
    assert wa.do("sha", "log.bin") == digest(content("one", 1 << 15))
    wb.do("write", "log.bin", "three", 3 << 15)
    b.sync()
    wa.send("append", "log.bin", "tail", 1)
    wa.answer()
    a.sync()
    want = content("three", 3 << 15) + content("tail", 1)
    got = (a.backing / "log.bin").read_bytes()
    assert len(got) == len(want) and got == want, \
        f"backing holds {len(got)} bytes, want {len(want)} (B's 3 MiB, then A's 16 bytes)"
    assert wb.do("sha", "log.bin") == digest(want)


def test_names_another_node_synced_are_seen_at_once(make_nodes, workers):
    """Right after B's sync: A's stat of a new file in a directory A has listed finds it; A
    reads B's version of a file A had written; A's `rm -rf s/` removes B's file too."""
    a, b = nodes(make_nodes)
    wa, wb = workers(a, b)
    wa.do("mkdir", "d")
    wa.do("write", "d/mine.bin", "a", 100)
    wa.do("write", "s/a.bin", "a", 100)
    a.sync()
    assert wa.do("ls", "d") == "mine.bin"
    assert wa.do("ls", "s") == "a.bin"
    wb.do("write", "d/new.bin", "b", 200)
    wb.do("write", "d/mine.bin", "b2", 300)
    wb.do("write", "s/b.bin", "b", 100)
    b.sync()
    assert wa.do("stat", "d/new.bin") == str(200 * 32)
    assert wa.do("sha", "d/mine.bin") == digest(content("b2", 300))
    assert wa.do("ls", "d") == "mine.bin,new.bin"
    wa.do("rmtree", "s")
    a.sync()
    assert not (a.backing / "s").exists(), f"left in the backing: {os.listdir(a.backing / 's')}"
    assert sorted(os.listdir(b.backing)) == [".acpfs-nodes", "d"]


def test_a_name_found_missing_is_kept_until_the_timeout_or_a_listing(make_nodes, workers):
    """A probes a missing name 500 times (as SQLite its -journal at every transaction): one
    LOOKUP reaches A's daemon, A's kernel answers the rest. B makes the name and syncs: A's
    kernel may still answer "missing" for up to the kernel's timeout (5 s here;
    docs/semantics.md, section 10), but A's listing of the directory shows it and drops that
    answer, and A then reads B's version at once. A second probed name that B makes shows on
    A by itself once the timeout ran out, not before (a poll for a file sees it late, never
    wrong). A name A never probed is found at once."""
    a, b = nodes(make_nodes)
    wa, wb = workers(a, b)
    wa.do("write", "d/db", "a", 10)
    a.sync()
    lookups = a.status()["requests"].get("lookup", 0)
    assert wa.do("probe", "d/db-journal", 500) == "0"
    probed = time.monotonic()
    assert a.status()["requests"].get("lookup", 0) - lookups <= 2, "each probe reached the daemon"
    wb.do("write", "d/db-journal", "b", 20)
    wb.do("write", "d/never-probed", "b", 40)
    b.sync()
    if time.monotonic() - probed < 4:   # (a slow machine may take the kernel's whole timeout)
        assert wa.do("probe", "d/db-journal", 1) == "0", "the kernel's answer was not kept"
    assert wa.do("stat", "d/never-probed") == str(40 * 32)
    assert wa.do("ls", "d") == "db,db-journal,never-probed"
    assert wa.do("probe", "d/db-journal", 1) == "1", "the listing did not drop the answer"
    assert wa.do("sha", "d/db-journal") == digest(content("b", 20))
    # without a listing: seen once the kernel's timeout ran out
    assert wa.do("probe", "d/polled", 1) == "0"
    probed = time.monotonic()
    wb.do("write", "d/polled", "b", 50)
    b.sync()
    if time.monotonic() - probed < 4:
        assert wa.do("probe", "d/polled", 1) == "0", "the kernel's answer was not kept"
    while wa.do("probe", "d/polled", 1) == "0":
        assert time.monotonic() - probed < 5 + 3, "a probed name never showed"
        time.sleep(0.05)
    assert wa.do("sha", "d/polled") == digest(content("b", 50))


def test_a_removed_name_is_gone_at_the_next_open(make_nodes, workers):
    """B removes a file A had read, and one A wrote itself (so A holds its content in its
    cache), and syncs: A's next open of each fails with ENOENT, not with the content A saw
    before."""
    a, b = nodes(make_nodes)
    wa, wb = workers(a, b)
    wb.do("write", "gone.bin", "x", 100)
    b.sync()
    wa.do("write", "mine.bin", "y", 100)
    a.sync()
    assert wa.do("sha", "gone.bin") == digest(content("x", 100))
    assert wb.do("sha", "mine.bin") == digest(content("y", 100))
    assert os.getxattr(a.path("mine.bin"), "user.acpfs.state") == b"persisted", \
        "A still holds what it wrote"
    wb.do("unlink", "gone.bin")
    wb.do("unlink", "mine.bin")
    b.sync()
    for name in ("gone.bin", "mine.bin"):
        ok, out = wa.attempt("sha", name)
        assert not ok and "FileNotFoundError" in out, (name, out)


def test_a_reader_keeps_its_version_while_another_opens_the_new_one(make_nodes):
    """A process on A holds the file open (version 1) while B publishes version 2: a new open
    on A reads version 2, the first descriptor goes on reading version 1, whole."""
    a, b = nodes(make_nodes)
    (b.path("f.bin")).write_bytes(content("one", 1 << 15))
    b.sync()
    with open(a.path("f.bin"), "rb") as old:
        assert old.read(10) == content("one", 1)[:10]
        b.path("f.bin").write_bytes(content("two", 3 << 15))
        b.sync()
        with open(a.path("f.bin"), "rb") as new:
            assert digest(new.read()) == digest(content("two", 3 << 15))
            assert os.fstat(new.fileno()).st_size == 3 << 20
        old.seek(0)
        assert digest(old.read()) == digest(content("one", 1 << 15))
    assert stat.S_ISREG(os.stat(a.path("f.bin")).st_mode)
