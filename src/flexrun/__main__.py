"""``python -m flexrun`` is the ``flexrun`` command."""

import sys

from flexrun.cli import main

sys.exit(main())
