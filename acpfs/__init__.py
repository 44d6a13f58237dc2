"""acpfs: a RAM-backed write-back FUSE cache that persists checkpoints atomically and in order."""

__version__ = "1.0.0"
