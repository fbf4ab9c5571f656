"""Moved to ``startrail_megatron.megatron.pretrain_gpt``; ``python -m startrail_megatron.pretrain_gpt`` runs it."""

from startrail_megatron.megatron.pretrain_gpt import main

if __name__ == "__main__":
    main()
