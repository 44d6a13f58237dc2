"""Replaying the op log onto the backing: the sequencer (``flusher``), one backing call until it
succeeds (``attempts``), the upload threads (``uploads``), landing a version under its names
(``publishing``), what is repaired when the backing lost what this node left (``repairs``),
conflicts with other writers (``conflicts``), and the close-to-durable histogram
(``histogram``).

Owns: the upload threads, the sequencer thread, the counters of what was persisted.
May import: ``cluster``, ``cache``, ``oplog``, ``store``, ``backing``, the package root.
"""
