"""Shared by the compression tests: a tiny Llama and text sampled from it (calibration and held-out)."""

from __future__ import annotations

import pytest
import torch

from tests.tasks.compression.test_rtn import VOCAB, tiny_llama


def self_samples(model, n: int, length: int, seed: int) -> torch.Tensor:
    """(n, length) token ids the model itself generates: text from the model's own distribution, so
    calibration statistics and the held-out loss are those of 'real' inputs, not uniform noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, 1), generator=g)
    past = None
    out = [x]
    with torch.no_grad():
        for _ in range(length - 1):  # with a KV cache: one new token per step
            step = model(input_ids=out[-1], past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(torch.multinomial(step.logits[:, -1].softmax(-1), 1, generator=g))
    return torch.cat(out, 1)


@pytest.fixture(scope="session")
def model_and_text():
    """``(model, calib (8, 64), held_out (8, 64))``; the two samples are disjoint draws."""
    model = tiny_llama()
    both = self_samples(model, 16, 64, seed=1)
    return model, both[:8], both[8:]
