"""``python -m hyla`` is the ``hyla`` command."""

import sys

from hyla.cli import main

sys.exit(main())
