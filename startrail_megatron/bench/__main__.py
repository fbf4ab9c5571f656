"""``python -m startrail_megatron.bench``: the ``startrail-bench`` console script."""

import sys

from . import main

sys.exit(main())
