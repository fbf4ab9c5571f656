"""``python -m startrail_megatron.planner``: the ``startrail-plan`` CLI."""

import sys

from .cli import main

sys.exit(main())
