"""torchtitan's own model code, built as its flavors build it: the model library side of
torchtitan (its parallelize step, a trainer, is :mod:`hyperrecipe.trainers.torchtitan`).

torchtitan is imported only when a builder here runs (``build_model``'s
``hyperrecipe.models.torchtitan:build_llama3``, ``:build_qwen3`` or ``:build_deepseek_v3``
factory); nothing of hyperrecipe imports this module otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["build_deepseek_v3", "build_llama3", "build_qwen3"]


def build_llama3(*, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 vocab_size: int = 256, max_seq_len: int = 64, multiple_of: int = 32,
                 fuse_qkv: bool = True) -> nn.Module:
    """torchtitan's ``Llama3Model`` at the given size, as torchtitan's flavors build it.

    The layers are torchtitan's own (``Llama3TransformerBlock``, ``GQAttention`` with its fused
    ``qkv_linear.wqkv``, ``FeedForward``, ``RMSNorm``, ``ComplexRoPE``) with the same
    initializers as its ``debugmodel``. The inner attention is torchtitan's
    ``ScaledDotProductAttention`` (causal), because its default FlexAttention compiles a kernel
    that CPU test ranks cannot afford; the module names, and so the recipe, are the same.
    Parameters are created on the current default device (``build_model`` puts them on meta).
    """
    from functools import partial

    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                wqkv_param_init=linear_init, wo_param_init=linear_init,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse_qkv,
                rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len,
                                        theta=500000)),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=multiple_of),
                w1_param_init=linear_init, w2w3_param_init=linear_init))
        for _ in range(n_layers)]
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_,
                                                                      std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init=linear_init),
        layers=layers)
    model: nn.Module = config.build()
    return model


def build_qwen3(*, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                head_dim: int = 32, hidden_dim: int = 128, vocab_size: int = 256,
                max_seq_len: int = 64, enable_weight_tying: bool = True,
                fuse_qkv: bool = True) -> nn.Module:
    """torchtitan's dense ``Qwen3Model`` at the given size, as its ``debugmodel`` flavor builds it.

    The layers are torchtitan's own (``Qwen3TransformerBlock``, ``GQAttention`` with its fused
    ``qkv_linear.wqkv`` and the per-head ``q_norm``/``k_norm`` over ``head_dim``, ``CosSinRoPE``,
    ``FeedForward``, ``RMSNorm`` with eps 1e-6) with the same initializers and, by default, the
    same tied ``tok_embeddings``/``lm_head`` weight as its flavors. ``head_dim * n_heads`` need
    not equal ``dim`` (it does not in Qwen3's flavors: 16 heads of 128 on dim 256 or 1024). The
    inner attention is torchtitan's ``ScaledDotProductAttention`` (causal) for the reason given
    in :func:`build_llama3`; the module names, and so the recipe, are the same as with its
    FlexAttention.
    """
    from functools import partial

    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import skip_param_init
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=1e-6,
                              param_init={"weight": nn.init.ones_})

    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim), ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                wqkv_param_init=linear_init, wo_param_init=linear_init,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse_qkv,
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len,
                                       theta=1000000.0),
                qk_norm=norm(head_dim)),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden_dim,
                                         w1_param_init=linear_init,
                                         w2w3_param_init=linear_init))
        for _ in range(n_layers)]
    config = Qwen3Model.Config(
        dim=dim, vocab_size=vocab_size, norm=norm(dim), enable_weight_tying=enable_weight_tying,
        # tied: the embedding skips its init and takes lm_head's, as torchtitan's flavors do
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim,
            param_init={"weight": skip_param_init if enable_weight_tying
                        else partial(nn.init.normal_, std=0.02)}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init=linear_init),
        layers=layers)
    model: nn.Module = config.build()
    return model


def build_deepseek_v3(*, dim: int = 64, n_layers: int = 2, n_dense_layers: int = 1,
                      n_heads: int = 4, q_lora_rank: int = 0, kv_lora_rank: int = 32,
                      qk_nope_head_dim: int = 16, qk_rope_head_dim: int = 8,
                      v_head_dim: int = 16, dense_hidden_dim: int = 128,
                      moe_hidden_dim: int = 32, num_experts: int = 4,
                      num_shared_experts: int = 1, top_k: int = 2, vocab_size: int = 256,
                      max_seq_len: int = 64) -> nn.Module:
    """torchtitan's ``DeepSeekV3Model`` (MLA attention, MoE after ``n_dense_layers`` dense
    layers) at the given size, as its ``debugmodel`` flavor builds it.

    The layers come from torchtitan's own ``build_mla_moe_layers`` with DeepSeek-V3's
    initializers: MLA ``Attention`` (``wq``, or ``wq_a``/``q_norm``/``wq_b`` when
    ``q_lora_rank > 0``; ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``; YaRN-scaled ``ComplexRoPE``),
    ``MoE`` (softmax ``router.gate``, ``routed_experts.inner_experts`` as ``GroupedExperts``
    with 3-D ``w1_EFD``/``w2_EDF``/``w3_EFD``, ``shared_experts`` as a ``FeedForward``) and
    torchtitan's local token dispatcher (no expert parallel). torchtitan's ``GroupedExperts``
    computes in bf16 whatever the parameters' dtype (its forward casts input and weights before
    ``torch._grouped_mm``; there is no fp32 path), so an fp32 model still has bf16 routed
    experts. The inner attention is torchtitan's causal ``ScaledDotProductAttention`` for the
    reason given in :func:`build_llama3` (torchtitan's helper accepts only FlexAttention or
    varlen for it; the module names, and so the recipe, are the same).
    """
    from functools import partial

    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.deepseek_v3 import build_mla_moe_layers
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}

    def depth_init(layer_id: int) -> dict[str, Any]:
        std = depth_scaled_std(0.02, layer_id)
        return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}

    def depth_experts_init(layer_id: int) -> dict[str, Any]:
        std = depth_scaled_std(0.02, layer_id)
        return {"w1_EFD": partial(nn.init.trunc_normal_, std=0.02),
                "w2_EDF": partial(nn.init.trunc_normal_, std=std),
                "w3_EFD": partial(nn.init.trunc_normal_, std=std)}

    layers = build_mla_moe_layers(
        n_layers=n_layers, n_dense_layers=n_dense_layers, dim=dim, n_heads=n_heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, mscale=0.70,
        dense_hidden_dim=dense_hidden_dim, moe_hidden_dim=moe_hidden_dim,
        num_experts=num_experts, num_shared_experts=num_shared_experts, router_top_k=top_k,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=linear_init, norm_init=norm_init,
        depth_init=depth_init, depth_experts_init=depth_experts_init,
        rope=ComplexRoPE.Config(dim=qk_rope_head_dim, max_seq_len=max_seq_len, theta=10000.0,
                                scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                                beta_slow=1.0, original_seq_len=max_seq_len))
    for layer in layers:  # the helper names FlexAttention; the CPU ranks run SDPA
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    s = dim ** -0.5
    config = DeepSeekV3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_,
                                                                      std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init={
            "weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s),
            "bias": nn.init.zeros_}),
        layers=layers)
    model: nn.Module = config.build()
    return model
