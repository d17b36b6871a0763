"""The tiny Llama every sparse-inference test runs on (random weights, seeded)."""

from __future__ import annotations

import torch

VOCAB, HIDDEN, INTER = 256, 64, 128


def tiny_llama(*, kv_heads: int = 4, seed: int = 0, max_positions: int = 256):
    """A 2-layer LlamaForCausalLM (hidden 64, 4 heads, ``kv_heads`` KV heads) in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      use_cache=False, tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits
