"""GPT pre-training with megatron-core and StarTrail: ``python scripts/pretrain_gpt.py --help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from startrail_megatron.megatron.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    main()
