"""``python -m gwenlake_hpc.stores.tracking``: the delivery process's command line before the tracking sub-packages.

Kept so that it still starts the delivery process (:mod:`.delivery.deliverer`): a training running the older code
(its Python already loaded) starts or restarts its delivery process with this command line, and finds the new
code on disk after an update of an editable install. New code runs ``python -m gwenlake_hpc.stores.tracking.delivery``.
"""

import sys

from .delivery.deliverer import main

sys.exit(main())
