"""``python -m gwenlake_hpc.stores.tracking.delivery``: the delivery process a Tracker starts (:mod:`.deliverer`)."""

import sys

from .deliverer import main

sys.exit(main())
