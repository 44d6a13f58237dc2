"""``python -m acpfs`` is the ``acpfs`` command."""
import sys

from .cli import main

sys.exit(main())
