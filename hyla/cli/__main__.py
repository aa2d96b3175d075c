"""``python -m hyla.cli`` (as ``torchrun -m hyla.cli`` needs) is the ``hyla`` command."""

import sys

from hyla.cli.main import main

sys.exit(main())
