"""``python -m startrail_megatron.gpu_check``."""

import sys

from .cli import main

sys.exit(main())
