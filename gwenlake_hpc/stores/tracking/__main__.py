"""``python -m gwenlake_hpc.stores.tracking``: the delivery process a Tracker starts (see :mod:`.delivery`)."""

import sys

from .delivery import main

sys.exit(main())
