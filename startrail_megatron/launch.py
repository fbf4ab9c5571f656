"""Moved to ``startrail_megatron.megatron.launch``; ``python -m startrail_megatron.launch`` runs it."""

from startrail_megatron.megatron.launch import main

if __name__ == "__main__":
    main()
