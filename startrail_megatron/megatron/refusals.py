"""The Megatron features StarTrail refuses, in one table.

Megatron flags (dest names of Megatron-LM core_r0.16.0 / megatron-core 0.16
``TransformerConfig``) whose feature needs something from ``core_attention``
that ``StarTrailCoreAttention`` does not provide. Argument validation
(``arguments.validate_startrail_args``) refuses the flags, and the attention
module the same ``TransformerConfig`` fields (for runs that bypass our flags).
"""

__all__ = ["REFUSED_FLAGS", "causal_window_error", "deterministic_mode_error"]

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
    "batch_invariant_mode": "asks for attention whose results do not depend on the batch "
    "(megatron-core's flash backend), which StarTrail's kernels do not promise",
    "fp8_dot_product_attention": "asks for fp8 attention, which StarTrail's kernels do not "
    "run (they take bf16, fp16 or fp32)",
    "fp8_multi_head_attention": "asks for fp8 attention, which StarTrail's kernels do not run "
    "(they take bf16, fp16 or fp32)",
}


def deterministic_mode_error(on_gpu: bool) -> str | None:
    """Why ``deterministic_mode`` (``--deterministic-mode``) cannot run here, or ``None``:
    on CPU ranks every kernel's backward is deterministic; on GPUs StarTrail's kernels
    (flash-attn, Transformer Engine, SDPA) run theirs without a deterministic option yet,
    where megatron-core's own attention would refuse or honour it."""
    if not on_gpu:
        return None
    return (
        "deterministic_mode (--deterministic-mode) is not supported with --context-parallel-"
        "impl startrail on GPUs yet: StarTrail's GPU kernels (flash-attn, Transformer "
        "Engine, SDPA) run a backward that may not be deterministic"
    )


def causal_window_error(window: tuple, name: str) -> str:
    """Why a causal layer's sliding window must have right = 0: StarTrail (as Transformer
    Engine and flash-attn do) attends no later token, while megatron-core's own local
    attention would attend ``right`` later ones (its band mask is not clipped at the
    diagonal): the two would train different models, silently."""
    left, right = window
    return (
        f"{name} {left},{right}: a causal layer's window takes right = 0 ({left},0); "
        f"StarTrail attends no later token, while megatron-core's local attention would "
        f"attend {right} later ones"
    )
