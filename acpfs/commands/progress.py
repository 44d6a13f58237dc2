"""How the commands show what they wait for: a progress line (redrawn in place on a
terminal, a plain line every few seconds in a log) and a bar. Ages and names made safe to
print are ``config.age`` and ``config.safe``."""

from __future__ import annotations

import sys
import time


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
