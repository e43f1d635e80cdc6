"""``python -m qkv``: same as the ``qkv`` command."""

import sys

from .cli import main

sys.exit(main())
