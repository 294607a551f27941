"""``python -m ditops`` is the ``ditops`` command."""

import sys

from ditops.cli import main

if __name__ == "__main__":  # importing the module (docs tools, inspection) runs nothing
    sys.exit(main())
