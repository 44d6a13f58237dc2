"""How the commands show what they wait for and what they report to a person: a progress
line (redrawn in place on a terminal, a plain line every few seconds in a log), a bar,
ages, and names made safe to print."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """A progress line: redrawn in place on a TTY, a plain line every few seconds otherwise."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0
        self.shown = False

    def update(self, text: str, news: bool = False) -> None:
        """Show ``text``; ``news``: it says something new (not only new figures), so a log
        gets it at once too."""
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self.shown = True
        elif news or now - self.last >= 5.0:
            self.last = now
            self.stream.write(text + "\n")
            self.stream.flush()

    def done(self, text: str | None = None) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
        if text:
            self.stream.write(text + "\n")
        self.stream.flush()


def bar(fraction: float, width: int = 24) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(fraction * width)
    return "[" + "#" * full + "." * (width - full) + f"] {fraction * 100:3.0f}%"


def safe(text: str) -> str:
    """``text`` with control characters escaped, for a line a human reads (a name holding a
    newline must not print a line of its own)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def age(s: float) -> str:
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def held_text(held: dict[str, Any]) -> str:
    who = f"node {held['waiting_for']}" if held["waiting_for"] else "a fresh listing of the nodes"
    return (f"held for global order {age(max(0.0, time.time() - held['since']))}: "
            f"{held['op']} {safe(held['path'])} waits for {who}")
