"""The `training:` section of params/training.yaml: model shapes, the token ladder, optimiser and RePB.

Shape rule (one rule for every rung, so the ladder varies N smoothly):

* ``head_dim = d_model / n_heads`` must be an even integer (RoPE rotates pairs);
* ``n_kv_heads`` defaults to ``n_heads`` (plain multi-head attention);
* the SwiGLU width is ``intermediate_size = ffn_multiple_of * ceil(ffn_mult * d_model / ffn_multiple_of)``
  with ``ffn_mult = 8/3`` and ``ffn_multiple_of = 32`` by default — LLaMA's rule (Touvron et al., 2023),
  which keeps the SwiGLU MLP's 3 matrices at the parameter count of a 4x GELU MLP's 2.

Load with ``load_stage_config(TrainingConfig, root, "training", preset)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tasks.common.config import require


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Width and depth of one rung of the ladder (see the module docstring for the shape rule)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: equal to n_heads (no grouped-query attention)
    ffn_mult: float = 8.0 / 3.0
    ffn_multiple_of: int = 32

    def __post_init__(self) -> None:
        require(self.d_model > 0, "d_model", f"must be positive, got {self.d_model}")
        require(self.n_layers > 0, "n_layers", f"must be positive, got {self.n_layers}")
        require(self.n_heads > 0, "n_heads", f"must be positive, got {self.n_heads}")
        require(self.d_model % self.n_heads == 0, "n_heads",
                f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        require((self.d_model // self.n_heads) % 2 == 0, "n_heads",
                f"head_dim {self.d_model // self.n_heads} must be even (RoPE rotates pairs of channels)")
        if self.n_kv_heads is not None:
            require(self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                    f"must divide n_heads {self.n_heads}, got {self.n_kv_heads}")
        require(self.ffn_mult > 0, "ffn_mult", f"must be positive, got {self.ffn_mult}")
        require(self.ffn_multiple_of > 0, "ffn_multiple_of", f"must be positive, got {self.ffn_multiple_of}")

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


@dataclass(frozen=True, kw_only=True)
class RePBConfig:
    """RePB dynamic data pruning (see :mod:`tasks.training.repb` for the method and each choice).

    ``window``: number of recent batches whose loss scores form the comparison pool (the model
    changes little across them: the "near-constant model state"). ``keep_ratio``: fraction of
    samples whose loss is back-propagated. ``prior``: pseudo-count of the selection-frequency
    estimate (a sample never seen before gets frequency ``keep_ratio``). ``weight_min``/``weight_max``
    clip the temporal rescaling weight ``keep_ratio / frequency``.

    ``enabled`` prunes every run of the ladder. ``compare`` names data variants whose ladder is
    instead trained twice, at equal optimizer steps, without and with RePB (the method's own
    comparison); the pruned arm is reported as the variant ``<variant>+repb``, so the fit stage
    gives it a law of its own and flags a reversal against the unpruned one.
    """

    enabled: bool = False
    compare: tuple[str, ...] = ()
    window: int = 8
    keep_ratio: float = 0.7
    prior: float = 1.0
    weight_min: float = 0.5
    weight_max: float = 2.0

    def __post_init__(self) -> None:
        require(not (self.enabled and self.compare), "repb.compare",
                "set either enabled (prune every run) or compare (variants trained with and without RePB)")
        require(len(set(self.compare)) == len(self.compare), "repb.compare", f"has duplicates: {self.compare}")
        require(self.window >= 1, "repb.window", f"must be >= 1, got {self.window}")
        require(0.0 < self.keep_ratio <= 1.0, "repb.keep_ratio", f"must be in (0, 1], got {self.keep_ratio}")
        require(self.prior > 0, "repb.prior", f"must be positive, got {self.prior}")
        require(0 < self.weight_min <= 1.0 <= self.weight_max, "repb.weight_min",
                f"need 0 < weight_min <= 1 <= weight_max, got {self.weight_min}, {self.weight_max}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Everything the train stage needs: the ladder (sizes x token_budgets) and one recipe for all rungs.

    Each run's step count is ``round(tokens / (batch_size * grad_accum * seq_len))`` and its
    learning-rate schedule (linear warmup over ``warmup_frac`` of its steps, cosine decay to
    ``lr * min_lr_ratio``) is stretched over its own step count, as Chinchilla prescribes
    (a cosine cycle longer than the run overestimates the loss; Hoffmann et al. 2022, Fig. A1).
    """

    vocab_size: int = 4096  # the tokenizer's size; the tokenizer is trained to exactly this
    seq_len: int = 128
    # A list, not a name->shape mapping: presets replace lists whole but merge mappings key by key.
    # Each rung is named by its shape tag (d64_l2).
    sizes: tuple[ModelShape, ...]
    token_budgets: tuple[int, ...]
    arch: Literal["llama", "xlstm"] = "llama"
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.05
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_interval: int = 100  # steps between validation evaluations (and at the end)
    eval_tokens: int = 65536  # validation tokens evaluated (the first ones of the val split)
    log_interval: int = 10  # steps between on_metrics calls / history points
    checkpoint_interval: int = 200  # steps between resumable checkpoints; 0 disables them
    seed: int = 0
    compile: bool = False  # torch.compile the model (worth it on GPU for the larger rungs)
    # torch intra-op threads while a run trains (restored afterwards); 0 leaves torch's setting.
    # Tiny models on a busy 2-core machine run several times faster on 1 thread.
    num_threads: int = 0
    variants: tuple[str, ...] = ()  # curated variants to train; empty = every variant
    repb: RePBConfig = field(default_factory=RePBConfig)

    def __post_init__(self) -> None:
        require(self.vocab_size >= 256, "vocab_size", f"must be >= 256 (byte-level BPE), got {self.vocab_size}")
        require(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        require(len(self.sizes) > 0, "sizes", "needs at least one model shape")
        require(all(isinstance(s, ModelShape) for s in self.sizes), "sizes",
                "every item must be a ModelShape")
        tags = [s.tag for s in self.sizes]
        require(len(set(tags)) == len(tags), "sizes", f"two sizes share a d_model/n_layers tag: {tags}")
        require(len(self.token_budgets) > 0, "token_budgets", "needs at least one budget")
        require(all(t > 0 for t in self.token_budgets), "token_budgets", f"must be positive, got {self.token_budgets}")
        require(len(set(self.token_budgets)) == len(self.token_budgets), "token_budgets",
                f"has duplicates: {self.token_budgets}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(0.0 <= self.warmup_frac < 1.0, "warmup_frac", f"must be in [0, 1), got {self.warmup_frac}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"must be in [0, 1), got {self.betas}")
        require(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")
        require(self.eval_interval >= 1, "eval_interval", f"must be >= 1, got {self.eval_interval}")
        require(self.eval_tokens > self.seq_len, "eval_tokens",
                f"must exceed seq_len {self.seq_len} (at least one window), got {self.eval_tokens}")
        require(self.log_interval >= 1, "log_interval", f"must be >= 1, got {self.log_interval}")
        require(self.checkpoint_interval >= 0, "checkpoint_interval",
                f"must be >= 0 (0 disables), got {self.checkpoint_interval}")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0 = torch's default), got {self.num_threads}")
        require(len(set(self.variants)) == len(self.variants), "variants", f"has duplicates: {self.variants}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len
