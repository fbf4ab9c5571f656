"""The Megatron features StarTrail refuses, in one table.

Megatron flags (dest names of Megatron-LM core_r0.16.0 / megatron-core 0.16
``TransformerConfig``) whose feature needs something from ``core_attention``
that ``StarTrailCoreAttention`` does not provide. Argument validation
(``arguments.validate_startrail_args``) refuses the flags, and the attention
module the same ``TransformerConfig`` fields (for runs that bypass our flags).
"""

__all__ = ["REFUSED_FLAGS"]

REFUSED_FLAGS = {
    "qk_clip": "needs the per-head max attention logit (core_attention.current_max_attn_logits), "
    "which StarTrail attention does not compute",
    "log_max_attention_logit": "needs the per-head max attention logit "
    "(core_attention.current_max_attn_logits), which StarTrail attention does not compute",
    # Megatron-LM's dev branch (2026-12): hybrid CP renamed, its groups made by
    # initialize_model_parallel(dynamic_context_parallel=True), which the hooks do not read
    "dynamic_context_parallel": "is Megatron-LM's dev-branch dynamic CP (hybrid CP renamed, "
    "in no release up to core_r0.19.0), whose sub-groups StarTrail does not register; use "
    "--hybrid-context-parallel with a release (megatron-core 0.16 - 0.19)",
}
