"""``python -m hlo_tools``: the ``hlo-tools`` command line."""

import sys

from hlo_tools.cli import main

sys.exit(main())
