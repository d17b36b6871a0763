"""Models of the ladder: randomly initialised Llama (or xLSTM) causal LMs from `transformers`, no hub.

Choices, the same for every rung:

* **Shape rule** (:class:`ModelShape`, one rule for every rung, so the ladder varies N smoothly):
  ``head_dim = d_model / n_heads`` must be an even integer (RoPE rotates pairs); ``n_kv_heads``
  defaults to ``n_heads``; the SwiGLU width is ``ffn_multiple_of * ceil(ffn_mult * d_model /
  ffn_multiple_of)`` with ``ffn_mult = 8/3``, ``ffn_multiple_of = 32`` — LLaMA's rule (Touvron et
  al., 2023), which keeps the SwiGLU MLP's 3 matrices at the parameter count of a 4x GELU MLP's 2.
* **Untied** input embedding and LM head, so small rungs do not get a free "shared" head.
* **Parameter counts, both recorded** (:func:`parameter_counts`): ``total`` counts every weight,
  embedding and head included, as Hoffmann et al. 2022 and Epoch AI do; ``non_embedding`` leaves
  out the token embedding and the LM head, as Kaplan et al. 2020 do. At the demo's widths the
  embedding and head are a large, size-dependent share of the model, and Pearce & Song 2024 /
  Porian et al. 2024 trace much of the Kaplan–Chinchilla disagreement to exactly this choice; the
  fit stage's ``n_definition`` picks one (default ``total``).
* **One FLOPs definition** (:func:`model_flops_per_token`): training FLOPs per token
  ``6 * N_total + 12 * n_layers * seq_len * d_model`` — PaLM's (Chowdhery et al. 2022, App. B)
  ``6N + 12 L H Q T`` with ``H Q = d_model``, the embedding and head counted in N as matmuls.
  The same number is MFU's numerator, MLflow's ``flops`` and the fit stage's C.
* Llama: RMSNorm, SwiGLU MLP (width from :class:`ModelShape`), RoPE (theta 10,000), no biases,
  no dropout, std-0.02 normal init (`transformers`' ``_init_weights``), SDPA attention.
* xLSTM (``arch="xlstm"``, mLSTM blocks of `transformers`' ``xLSTMForCausalLM``): ``qk_dim_factor=1``
  (0.5 gives odd head dims that break at small widths), the same SwiGLU width rule, the chunkwise
  kernel in ``mode="train"``, whose chunk (``gcd(seq_len, 64)``) must divide the sequence length —
  so evaluate on windows of ``seq_len``. Call it with ``use_cache=False`` (backward needs it).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from tasks.common.config import positive, require

_HF_IMPORT = threading.RLock()


def hf_class(name: str) -> Any:
    """A class of ``transformers`` by name, resolved under one lock.

    ``transformers`` imports its classes lazily, and two threads of a stage's task pool resolving
    a class for the first time at once can fail with "cannot import name 'LlamaConfig'" (seen in
    ``make demo``'s sparse_eval with two local workers); the lock makes the first resolution serial.
    """
    with _HF_IMPORT:
        import transformers

        return getattr(transformers, name)


@contextlib.contextmanager
def transformers_lock() -> Iterator[None]:
    """Hold :func:`hf_class`'s lock around every ``from_pretrained`` and every model construction.

    For the length of a ``from_pretrained`` call, ``transformers`` swaps ``PreTrainedModel.tie_weights``,
    ``PreTrainedModel.init_weights`` and the ``torch.nn.init`` functions for no-ops, process-wide
    (``transformers.initialization.no_init_weights`` / ``no_tie_weights``) and puts back what it saved.
    Two loads in two threads of a stage's task pool can save each other's no-ops and leave them in
    place for the rest of the process: in a demo's prune stage two PASER threads loaded MiniLM at
    once, and SmolLM2 loaded afterwards had an untied ``lm_head`` of zeros (every perplexity equal
    to the vocabulary size). A model built in one thread while another loads would get no
    initialisation either. It also keeps `transformers`' lazy imports serial (a ladder task
    resolving ``LlamaConfig`` beside a load failed with "module 'transformers' has no attribute
    'LlamaConfig'"). Re-entrant, so ``hf_class`` may be called inside."""
    with _HF_IMPORT:
        yield


def resolve_llama_classes() -> None:
    """Import the Llama classes ladder models are built from, in the calling thread.

    A stage whose task pool runs SmolLM2 beside ladder models calls it before starting the pool, so
    that no ladder task imports them while SmolLM2's task is inside `transformers` (its forward
    passes import modules lazily too, outside :func:`transformers_lock`)."""
    for name in ("LlamaConfig", "LlamaForCausalLM"):
        hf_class(name)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Width and depth of one rung of the ladder (the shape rule: see the module docstring)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: equal to n_heads (no grouped-query attention)
    ffn_mult: float = 8.0 / 3.0
    ffn_multiple_of: int = 32

    def __post_init__(self) -> None:
        positive(self.d_model, "d_model")
        positive(self.n_layers, "n_layers")
        positive(self.n_heads, "n_heads")
        require(self.d_model % self.n_heads == 0, "n_heads",
                f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                f"head_dim {self.d_model // self.n_heads} must be even (RoPE rotates pairs of channels)")
        if self.n_kv_heads is not None:
            require(self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                    f"must divide n_heads {self.n_heads}, got {self.n_kv_heads}")
        positive(self.ffn_mult, "ffn_mult")
        positive(self.ffn_multiple_of, "ffn_multiple_of")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def intermediate_size(self) -> int:
        """SwiGLU hidden width: ``ffn_mult * d_model`` rounded up to a multiple of ``ffn_multiple_of``."""
        m = self.ffn_multiple_of
        return m * math.ceil(self.ffn_mult * self.d_model / m - 1e-9)

    @property
    def tag(self) -> str:
        """Short name used in run names, e.g. ``d64_l2``."""
        return f"d{self.d_model}_l{self.n_layers}"


Arch = Literal["llama", "xlstm"]


def hf_config(shape: ModelShape, vocab_size: int, seq_len: int, arch: Arch = "llama", eos_token_id: int = 0) -> Any:
    """The `transformers` config object for one rung (no weights)."""
    if arch == "llama":
        LlamaConfig = hf_class("LlamaConfig")

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=shape.d_model,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.n_layers,
            num_attention_heads=shape.n_heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            max_position_embeddings=seq_len,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            use_cache=False,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=None,
            attn_implementation="sdpa",
        )
    if arch == "xlstm":
        xLSTMConfig = hf_class("xLSTMConfig")

        return xLSTMConfig(
            vocab_size=vocab_size,
            hidden_size=shape.d_model,
            num_hidden_layers=shape.n_layers,
            num_heads=shape.n_heads,
            qk_dim_factor=1.0,
            v_dim_factor=1.0,
            ffn_proj_factor=shape.ffn_mult,
            ffn_round_up_to_multiple_of=shape.ffn_multiple_of,
            mode="train",
            chunk_size=math.gcd(seq_len, 64),
            autocast_kernel_dtype="bfloat16" if torch.cuda.is_available() else "float32",
            tie_word_embeddings=False,
            use_cache=False,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=None,
        )
    raise ValueError(f"arch: expected 'llama' or 'xlstm', got {arch!r}")


def build_model(shape: ModelShape, vocab_size: int, seq_len: int, arch: Arch = "llama", seed: int = 0) -> nn.Module:
    """A freshly initialised causal LM; the same ``seed`` gives bit-identical weights.

    The global torch RNG is left as it was (initialisation runs under ``fork_rng``).

    >>> m = build_model(ModelShape(d_model=64, n_layers=2, n_heads=4), 512, 128)
    >>> m(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False).logits.shape
    torch.Size([1, 8, 512])
    """
    config = hf_config(shape, vocab_size, seq_len, arch)
    with torch.random.fork_rng(devices=[]), transformers_lock():
        torch.manual_seed(seed)
        if arch == "llama":
            LlamaForCausalLM = hf_class("LlamaForCausalLM")

            model = LlamaForCausalLM(config)
        else:
            xLSTMForCausalLM = hf_class("xLSTMForCausalLM")

            model = xLSTMForCausalLM(config)
    return model


def _embedding_params(model: nn.Module) -> set[int]:
    ids = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        mod = getattr(model, get)()
        if mod is not None:
            ids.add(id(mod.weight))
    return ids


def non_embedding_params(model: nn.Module) -> int:
    """N: parameters excluding the token embedding and the LM head (Kaplan et al. 2020, Sec. 2.1)."""
    skip = _embedding_params(model)
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) in skip or id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def total_params(model: nn.Module) -> int:
    """Every parameter, shared ones once (Hoffmann et al. 2022 count N this way)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class ParamCounts(NamedTuple):
    total: int
    non_embedding: int


def parameter_counts(shape: ModelShape, vocab_size: int, arch: Arch = "llama", seq_len: int = 128) -> ParamCounts:
    """Total and non-embedding parameters of a rung without allocating it (built on the meta device).

    >>> parameter_counts(ModelShape(d_model=32, n_layers=2, n_heads=2), 512)
    ParamCounts(total=59552, non_embedding=26784)
    """
    config = hf_config(shape, vocab_size, seq_len, arch)
    with torch.device("meta"):
        if arch == "llama":
            LlamaForCausalLM = hf_class("LlamaForCausalLM")

            model = LlamaForCausalLM(config)
        else:
            xLSTMForCausalLM = hf_class("xLSTMForCausalLM")

            model = xLSTMForCausalLM(config)
    return ParamCounts(total=total_params(model), non_embedding=non_embedding_params(model))


def count_non_embedding_params(shape: ModelShape, vocab_size: int, arch: Arch = "llama", seq_len: int = 128) -> int:
    """Non-embedding N of a rung (Kaplan et al.'s count)."""
    return parameter_counts(shape, vocab_size, arch, seq_len).non_embedding


class FlopsPerToken(NamedTuple):
    """Training FLOPs per token under scalelab's one convention (PaLM, Chowdhery et al. 2022, App. B).

    ``dense = 6 * N_total`` (2N forward + 4N backward over every weight, embedding and head
    included); ``attention = 12 * n_layers * seq_len * d_model`` (PaLM's ``12 L H Q T``: the
    QK^T and AV matmuls, forward and backward; 0 for xLSTM, whose recurrence is linear in
    ``seq_len``). ``lm_head = 6 * d_model * vocab`` is the part of ``dense`` spent in the head,
    kept for reference (Chinchilla App. F counts it; 6 * N_non_embedding omits it).
    """

    dense: float
    attention: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.dense + self.attention


def model_flops_per_token(shape: ModelShape, seq_len: int, vocab: int, arch: Arch = "llama") -> FlopsPerToken:
    """Training FLOPs per token of one rung; a run's C is ``.total * D``.

    >>> f = model_flops_per_token(ModelShape(d_model=64, n_layers=2, n_heads=4), 128, 512)
    >>> f.attention == 12 * 2 * 128 * 64
    True
    """
    n = parameter_counts(shape, vocab, arch, seq_len).total
    attention = 12.0 * shape.n_layers * seq_len * shape.d_model if arch == "llama" else 0.0
    return FlopsPerToken(dense=6.0 * n, attention=attention, lm_head=6.0 * shape.d_model * vocab)


# Dense bf16 tensor-core peaks (no sparsity), from NVIDIA's datasheets; MFU is left missing elsewhere.
# Matched as whole words of the device name, longest first, so an L40 is not taken for an L4.
_PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10G": 70e12,
    "L4": 121e12,
    "4090": 165e12,
}


def peak_flops_for_name(name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a CUDA device name, or None when the name is not in the table.

    >>> peak_flops_for_name("NVIDIA L40"), peak_flops_for_name("NVIDIA L4")
    (181000000000000.0, 121000000000000.0)
    """
    import re

    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return _PEAK_BF16_FLOPS[key]
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """Peak dense bf16 FLOP/s of a CUDA device if known, else None (CPU: None, MFU is not reported)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))
