"""``python -m startrail_megatron.pretrain_gpt``: see ``startrail_megatron.megatron.training``."""

import warnings

# megatron-core announces at import that optional CUDA accelerators (Apex, Transformer
# Engine) are absent; expected on CPU ranks, and repeated once per rank.
warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
)
warnings.filterwarnings("ignore", message=r".*full scope is deprecated")

from startrail_megatron.megatron.training.loop import main  # noqa: E402

if __name__ == "__main__":
    main()
