"""``python -m gwenlake_hpc``: see :mod:`gwenlake_hpc.cli.dispatch`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
