"""The release gate (``models promote``): a version against the incumbent before an alias moves (:mod:`.gate`).
Above the stores (it imports the registry), below the command line."""

from .gate import *  # noqa: F401,F403
from .gate import __all__  # noqa: F401
