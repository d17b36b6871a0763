"""Our top-level package `kernels` shares its name with Hugging Face's `kernels` (hub kernels).

transformers probes for that package with ``importlib.util.find_spec("kernels")`` plus a version
check; if it believed ours were it, it would try ``from kernels import get_kernel`` and fail. These
tests pin that it does not, and that a Llama model still builds and runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import kernels
import kernels.group_quant  # noqa: F401  (import the whole package before probing)
import kernels.sparse_gemv  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_does_see_our_package():
    # The check below is only meaningful if `kernels` resolves to this repository's package.
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    assert not hasattr(kernels, "__version__")  # a version would be compared against HF kernels' range
    assert not hasattr(kernels, "get_kernel")


def test_transformers_does_not_think_hf_kernels_is_installed():
    from transformers.utils import import_utils

    import_utils.is_kernels_available.cache_clear()
    assert import_utils.is_kernels_available() is False
    # The hub-kernels integration imports cleanly (it would `from kernels import ...` if it were fooled).
    import transformers.integrations.hub_kernels  # noqa: F401


def test_llama_builds_and_runs_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                      use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 128)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.5
