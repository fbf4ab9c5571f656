"""Every model builder that megatron-core offers reaches StarTrail, or is refused.

The hooks rewrite ``GPTModel``'s layer and MTP specs and (megatron-core >= 0.19)
``HybridModel``'s hybrid stack spec; ``spec.check_startrail_model`` then refuses, at build
time and by name, a model in which a layer would still mix tokens some other way on a CP
rank (an attention the rewrite did not reach, a Mamba mixer), since it would attend over
that rank's local tokens only.

The HybridModel case: a stack of attention layers (pattern ``*-*``: attention, MLP,
attention) at CP = 4 with StarTrail C = 2 against the same model at CP = 1, loss and every
parameter gradient in float32 to 1e-5 relative. Proof that StarTrail ran: each attention
layer's core attention is ``StarTrailCoreAttention`` and its K,V P2P bytes are recorded.
With an MTP depth (``*-/*``) the MTP layers, built from the same rewritten hybrid stack,
hold StarTrail too. Tests marked ``megatron_min`` need that megatron-core and are deselected (and counted in the
summary) on an older one: the Python 3.11 lane has 0.16, the 3.12 lane 0.19.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

SEQ, VOCAB, HIDDEN, HEADS = 32, 128, 64, 4


class MambaMixer(torch.nn.Module):
    """A stand-in with the class name of megatron-core's Mamba mixer (the real one needs
    CUDA kernels): the model check refuses by that name."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, *args, **kwargs):
        return self.proj(hidden_states), None


def _config(num_layers: int, cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        context_parallel_size=cp,
    )


def _on_ranks(cp: int, team: int, build):
    """Megatron's groups at ``cp`` with the StarTrail hooks installed; ``build()``'s result,
    or the text of the error it raised."""
    from megatron.core import parallel_state

    from startrail_megatron.megatron import cpu_support, hooks

    cpu_support.enable_cpu_support()
    hooks.install(team)
    try:
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        cpu_support.cpu_manual_seed(0)
        try:
            return build()
        except ValueError as e:
            return f"ValueError: {e}"
    finally:
        parallel_state.destroy_model_parallel()
        hooks.uninstall()
        cpu_support.disable_cpu_support()


def _hybrid_stack(mamba_layer=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = get_gpt_layer_local_spec()  # '*': a whole GPT layer (attention and MLP)
    mlp = TransformerLayerSubmodules(  # '-': its MLP alone
        pre_mlp_layernorm=local.submodules.pre_mlp_layernorm,
        mlp=local.submodules.mlp,
        mlp_bda=local.submodules.mlp_bda,
    )
    subs = HybridStackSubmodules(
        attention_layer=local, mlp_layer=ModuleSpec(module=TransformerLayer, submodules=mlp)
    )
    if mamba_layer is not None:
        subs.mamba_layer = mamba_layer
    return ModuleSpec(module=HybridStack, submodules=subs)


def _hybrid_loss_and_grads(rank, world, pattern):
    """HybridModel over the whole CP group: (loss sum, grads summed over CP, core attention
    kinds, local length, K,V P2P bytes of this rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from startrail_megatron.megatron import registry
    from startrail_megatron.megatron.versions import batch_on_this_cp_rank

    def build():
        model = HybridModel(
            _config(len(pattern), world),
            _hybrid_stack(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern=pattern,
            position_embedding_type="rope",
        )
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        batch = {
            "tokens": tokens,
            "labels": torch.roll(tokens, -1, 1),
            "position_ids": torch.arange(SEQ).expand(2, SEQ).contiguous(),
        }
        cp = parallel_state.get_context_parallel_group()
        local = batch_on_this_cp_rank(batch, cp) if world > 1 else batch
        loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            torch.distributed.all_reduce(g, group=cp)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=cp)
        kinds = [
            type(layer.self_attention.core_attention).__name__
            for layer in model.decoder.layers
            if hasattr(layer.self_attention, "core_attention")
        ]
        p2p = registry.get_startrail_state(cp).ledger.bytes("p2p") if world > 1 else 0
        return total.item(), grads, kinds, local["tokens"].shape[1], p2p

    return _on_ranks(world, 2 if world > 1 else 1, build)


def _megatron_has_hybrid_model() -> bool:
    from startrail_megatron.megatron.versions import megatron_version

    return megatron_version() >= (0, 19)


@pytest.mark.megatron_min(0, 19)
def test_hybrid_model_startrail_cp4_matches_cp1():
    assert _megatron_has_hybrid_model()
    (ref_loss, ref_grads, ref_kinds, ref_len, _) = run_ranks(1, _hybrid_loss_and_grads, "*-*")[0]
    got = run_ranks(4, _hybrid_loss_and_grads, "*-*")
    assert ref_len == SEQ and ref_kinds == ["StarTrailCoreAttention"] * 2
    for loss, grads, kinds, local_len, p2p in got:
        assert kinds == ["StarTrailCoreAttention"] * 2
        assert local_len == SEQ // 4 and p2p > 0
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert grads.keys() == ref_grads.keys() and grads
        for name, r in ref_grads.items():
            err = ((grads[name] - r).abs().max() / r.abs().max()).item()
            assert err <= 1e-5, f"{name}: {err:.2e}"


def _hybrid_with_mamba(rank, world):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    def build():
        HybridModel(
            _config(2, world),
            _hybrid_stack(mamba_layer=ModuleSpec(module=MambaMixer)),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern="*M",
        )
        return "built"

    return _on_ranks(world, 1, build)


@pytest.mark.megatron_min(0, 19)
def test_hybrid_model_with_a_mamba_layer_is_refused_on_cp_ranks():
    assert _megatron_has_hybrid_model()
    for msg in run_ranks(2, _hybrid_with_mamba):
        assert msg.startswith("ValueError") and "MambaMixer" in msg, msg
        assert "--context-parallel-impl startrail" in msg and "decoder.layers.1" in msg, msg
    assert run_ranks(1, _hybrid_with_mamba) == ["built"]  # CP = 1: nothing to split


class OwnCoreAttention(torch.nn.Module):
    """A user's core attention (Megatron's own refuses CP > 1 by itself)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _gpt_with_own_attention(rank, world):
    """A GPT layer spec whose self-attention is a user's subclass (a name the rewrite does
    not match) with a user's core attention: the rewrite leaves it, the build is refused."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    class OwnAttn(SelfAttention):
        pass

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.module = OwnAttn
    spec.submodules.self_attention.submodules.core_attention = OwnCoreAttention

    def build():
        GPTModel(_config(2, world), spec, VOCAB, SEQ, position_embedding_type="rope")
        return "built"

    return _on_ranks(world, 1, build)


def test_gpt_layer_the_rewrite_does_not_reach_is_refused_on_cp_ranks():
    for msg in run_ranks(2, _gpt_with_own_attention):
        assert msg.startswith("ValueError") and "OwnAttn with core attention" in msg, msg
        assert "decoder.layers.0.self_attention" in msg, msg
    assert run_ranks(1, _gpt_with_own_attention) == ["built"]


def _hybrid_with_mtp(rank, world):
    """HybridModel with one MTP depth ('*-/*'): its MTP layers are built from the same
    (rewritten) hybrid stack, so their attention is StarTrail's too."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mtp_layer = MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm,
        hnorm=WrappedTorchNorm,
        eh_proj=ColumnParallelLinear,
        mtp_model_layer=None,  # built from the hybrid stack's submodules
        layer_norm=WrappedTorchNorm,
    )
    stack = _hybrid_stack()
    stack.submodules.mtp_block_spec = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=mtp_layer)]
        ),
    )

    def build():
        cfg = _config(2, world)
        cfg.mtp_num_layers = 1
        model = HybridModel(
            cfg, stack, vocab_size=VOCAB, max_sequence_length=SEQ, hybrid_layer_pattern="*-/*"
        )
        return sorted(
            (name, type(m.core_attention).__name__)
            for name, m in model.named_modules()
            if hasattr(m, "core_attention")
        )

    return _on_ranks(world, 1, build)


@pytest.mark.megatron_min(0, 19)
def test_hybrid_model_mtp_layers_get_startrail():
    assert _megatron_has_hybrid_model()
    for built in run_ranks(2, _hybrid_with_mtp):
        assert isinstance(built, list), built
        names = [name for name, _ in built]
        assert any(n.startswith("mtp.") for n in names) and any(
            n.startswith("decoder.") for n in names
        ), names
        assert {kind for _, kind in built} == {"StarTrailCoreAttention"}, built
