"""The GPT pre-training application behind ``python -m startrail_megatron.pretrain_gpt``."""
