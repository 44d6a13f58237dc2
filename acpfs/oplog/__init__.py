"""The history of the mount: the op log (``log.OpLog``: the one lock of cache, flusher and
peers, the seqs, the queue, the stamps of global order), one class per kind of op (``ops``),
and the crash journal (``journal``).

Owns: the queue and ``lock``; the journal file.
May import: ``store`` (a publish holds a snapshot) and the package root.
"""
