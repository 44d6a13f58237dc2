"""``python -m acpfs`` is the ``acpfs`` command."""
import sys

from .commands.cli import main

sys.exit(main())
