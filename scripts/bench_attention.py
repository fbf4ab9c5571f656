#!/usr/bin/env python
"""Side-by-side attention benchmark (same as the ``startrail-bench`` console script).

    python scripts/bench_attention.py --nproc 4 --seq-len 4096
    torchrun --nproc-per-node 8 scripts/bench_attention.py --seq-len 65536 --dtype bf16

See ``startrail_megatron/bench/cli.py`` for what is measured and how.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from startrail_megatron.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
