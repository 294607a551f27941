"""``python -m ditops`` is the ``ditops`` command."""

import sys

from ditops.cli import main

sys.exit(main())
