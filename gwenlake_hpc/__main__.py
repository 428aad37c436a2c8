"""``python -m gwenlake_hpc``: see :mod:`gwenlake_hpc.cli.dispatch`."""

from .cli import main
from .runtime.distributed import exit_process

if __name__ == "__main__":
    exit_process(main())
