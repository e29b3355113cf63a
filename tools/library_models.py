"""Small models from libraries outside transformers, as ``--model`` factories, for
``tools/suggest_libraries.py``: the measurement of ``suggest`` on code hyperrecipe was not
written against (x-transformers, litgpt, vit-pytorch). Each factory builds the library's own
classes from a small config under the ambient device and takes keyword fields, as the factory
contract asks (docs/bring-your-own-model.md); nothing here patches the libraries.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch
from torch import nn

VOCAB = 256


def xt_decoder(**fields: Any) -> nn.Module:
    """x-transformers' decoder-only LM (pre-norm blocks, einops heads)."""
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=64,
                              attn_layers=Decoder(dim=64, depth=2, heads=4, **fields))


def xt_encoder(**fields: Any) -> nn.Module:
    """x-transformers' encoder (bidirectional) with a vocabulary head."""
    from x_transformers import Encoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=64,
                              attn_layers=Encoder(dim=64, depth=2, heads=4, **fields))


def _litgpt(**config: Any) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2,
                      n_head=4, n_embd=64, **config))


def litgpt_llama(**fields: Any) -> nn.Module:
    """litgpt's GPT as a Llama: fused qkv with grouped-query heads, SwiGLU, RMSNorm."""
    return _litgpt(n_query_groups=2, intermediate_size=128, bias=False,
                   norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                   rotary_percentage=1.0, parallel_residual=False, **fields)


def litgpt_pythia(**fields: Any) -> nn.Module:
    """litgpt's GPT as a Pythia: fused qkv, GELU MLP, parallel residual, partial rotary."""
    return _litgpt(bias=True, norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP",
                   intermediate_size=256, rotary_percentage=0.25, parallel_residual=True,
                   **fields)


def _module_file(package: str, name: str) -> ModuleType:
    """``package/name.py`` loaded on its own: vit-pytorch's ``__init__`` imports torchvision
    for models this file does not use."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named {package!r}")
    path = f"{list(spec.submodule_search_locations)[0]}/{name}.py"
    loaded = importlib.util.spec_from_file_location(f"{package}_{name}", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module
    loaded.loader.exec_module(module)
    return module


def vitp_vit(**fields: Any) -> nn.Module:
    """vit-pytorch's ViT (lucidrains): patches through einops, q/k/v fused, heads in einops."""
    vit = _module_file("vit_pytorch", "vit")
    return vit.ViT(image_size=16, patch_size=4, num_classes=10, dim=64, depth=2, heads=4,
                   mlp_dim=128, **fields)


def pixels(model: nn.Module, *, batch: int, seq: int, generator: torch.Generator
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Images for the ViTs above (16 x 16, RGB); ``seq`` is unused."""
    return (torch.randn(batch, 3, 16, 16, generator=generator),), {}
