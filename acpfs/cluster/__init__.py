"""Many nodes over one backing: this node's record and the others' (``peers``: leases,
promises, the rule that holds a change back), the records' format and directory (``records``:
parsing and writing a record's name, whose records count) and where the sequencer and
requests wait for global order (``globalorder``).

Owns: the node records' state of this daemon, the heartbeat thread.
May import: ``oplog``, ``backing``, the package root.
"""
