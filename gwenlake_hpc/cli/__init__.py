"""Command lines: ``python -m gwenlake_hpc`` and ``gwenlake-train`` (``dispatch``), the ``models`` sub-commands
(``models``) and ``report`` (``report``). May import every layer.

``gwenlake_hpc.cli.dispatch:train_main`` (the ``gwenlake-train`` entry point) and ``gwenlake_hpc.cli.dispatch:main`` stay valid."""

from .dispatch import discover, main, run_subcommand, train_entry, train_main

__all__ = ["main", "train_main", "train_entry", "run_subcommand", "discover"]
