"""GPT pre-training with megatron-core and StarTrail: ``python scripts/pretrain_gpt.py --help``."""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
warnings.filterwarnings("ignore", message=r".*full scope is deprecated")

from startrail_megatron.megatron.training.loop import main  # noqa: E402

if __name__ == "__main__":
    main()
