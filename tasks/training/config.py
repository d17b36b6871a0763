"""The `training:` section of params/training.yaml: model shapes (:class:`tasks.lm.model.ModelShape`),
the token ladder, optimiser and RePB.

Load with ``load_stage_config(TrainingConfig, root, "training", preset)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tasks.common.config import at_least, positive, require
from tasks.lm.model import ModelShape


@dataclass(frozen=True, kw_only=True)
class RePBConfig:
    """RePB dynamic data pruning (see :mod:`tasks.training.repb` for the method and each choice).

    Selection is per optimizer step (all its micro-batches together). ``window``: number of recent
    steps whose normalised loss scores form the comparison pool (1 = the step alone).
    ``score_norm``: how each step's scores are made comparable with older steps' although the loss
    falls — ``zscore`` (subtract the step's mean, divide by its std), ``center`` (subtract the mean
    only), ``rank`` (within-step rank in [0, 1]; with equal step sizes the pool then adds nothing
    and selection is the step's top ``keep_ratio``), ``none`` (raw losses, the drifting form).
    ``keep_ratio``: fraction of samples whose loss is back-propagated.

    Cumulative temporal rescaling: ``frequency_regions`` splits the sample ids (windows of the token
    stream, in stream order) into that many contiguous regions sharing one selection-frequency
    estimate, so the estimate builds up within a single epoch; 0 tracks each sample alone (the
    paper's per-sample form, which only acts once samples repeat, i.e. from the second epoch).
    ``prior``: pseudo-count of the frequency estimate (a region or sample not yet seen gets
    frequency ``keep_ratio``, weight 1). ``weight_min``/``weight_max`` clip the weight
    ``keep_ratio / frequency``.

    ``enabled`` prunes every run of the ladder. ``compare`` names data variants whose ladder is
    instead trained twice, at equal optimizer steps, without and with RePB (the method's own
    comparison); the pruned arm is reported as the variant ``<variant>+repb``, so the fit stage
    gives it a law of its own and flags a reversal against the unpruned one.
    """

    enabled: bool = False
    compare: tuple[str, ...] = ()
    window: int = 8
    score_norm: Literal["zscore", "center", "rank", "none"] = "zscore"
    keep_ratio: float = 0.7
    # 16 regions: a ci run (~256 samples) visits each ~16 times, so the estimate has data to act on.
    frequency_regions: int = 16
    prior: float = 1.0
    weight_min: float = 0.5
    weight_max: float = 2.0

    def __post_init__(self) -> None:
        require(not (self.enabled and self.compare), "repb.compare",
                "set either enabled (prune every run) or compare (variants trained with and without RePB)")
        require(len(set(self.compare)) == len(self.compare), "repb.compare", f"has duplicates: {self.compare}")
        at_least(self.window, 1, "repb.window")
        require(self.score_norm in ("zscore", "center", "rank", "none"), "repb.score_norm",
                f"must be zscore, center, rank or none, got {self.score_norm!r}")
        require(self.frequency_regions >= 0, "repb.frequency_regions",
                f"must be >= 0 (0: per sample), got {self.frequency_regions}")
        require(0.0 < self.keep_ratio <= 1.0, "repb.keep_ratio", f"must be in (0, 1], got {self.keep_ratio}")
        positive(self.prior, "repb.prior")
        require(0 < self.weight_min <= 1.0 <= self.weight_max, "repb.weight_min",
                f"need 0 < weight_min <= 1 <= weight_max, got {self.weight_min}, {self.weight_max}")


@dataclass(frozen=True, kw_only=True)
class FeasibilityConfig:
    """What the train stage does when a curated variant kept too few tokens for what the study asks of
    it (checked after curation, before any training: :mod:`tasks.training.feasibility`).

    A variant must hold its ladder's largest D within ``max_epochs`` passes over its training tokens,
    and the training-token windows the later stages take from it (compress's and sparse_eval's
    calibration, prune's calibration plus recovery). ``mode``:

    * ``shrink`` (default): the variant keeps the ladder points its data allows within ``max_epochs``
      and is left out of only the later stages it cannot feed; a variant with no point left is skipped;
    * ``skip``: a variant short of anything is left out of training and every later stage;
    * ``fail``: any shortfall stops the stage before training, naming every variant and key.

    ``max_epochs``: passes over a variant's training tokens a point may make (the fit stage leaves
    out runs above its own ``fit.max_epochs``, 1 by default, so points beyond it would be trained for
    nothing). ``size_to_data``: scale the design's budgets (``token_budgets`` or
    ``compute_budgets``, all by one factor) so that the ladder's largest D is ``max_epochs`` passes
    over the smallest trained variant's training tokens (:func:`tasks.training.feasibility.sized_to_data`).
    """

    mode: Literal["fail", "skip", "shrink"] = "shrink"
    max_epochs: float = 1.0
    size_to_data: bool = False

    def __post_init__(self) -> None:
        require(self.mode in ("fail", "skip", "shrink"), "mode", f"must be fail, skip or shrink, got {self.mode!r}")
        require(self.max_epochs > 0 and math.isfinite(self.max_epochs), "max_epochs",
                f"must be a positive number of passes, got {self.max_epochs}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Everything the train stage needs: the ladder's design and one recipe for all rungs.

    **Design.** Either a grid — every size x every ``token_budgets`` entry — or an IsoFLOP design:
    ``compute_budgets`` (training FLOPs, :func:`tasks.lm.model.model_flops_per_token`
    convention) with ``sizes_per_budget`` sizes per budget, chosen from ``sizes`` around the
    expected optimum ``tokens_per_param_guess`` and trained on ``D = C / flops_per_token(N)``
    (``C / 6N`` when attention is negligible), so Approach 2 sees a parabola at every level and
    Approach 3 a wide band of tokens per parameter (:func:`tasks.training.design.ladder`).

    **Schedule.** ``schedule: wsd`` (warmup-stable-decay; Hägele et al. 2024, MiniCPM): linear
    warmup over ``warmup_steps`` (None: ``warmup_frac`` of the ladder's shortest run, so every
    budget of a size shares it), constant ``lr``, then a cooldown over the last ``cooldown_frac``
    of the run's steps to 0 (``cooldown_shape`` linear or ``1-sqrt``). Each size trains one stable
    run, and each budget is a cooldown branch from the stable run's checkpoint at the start of its
    cooldown: a properly annealed run per (N, D) for about ``max(D) * (1 + cooldown_frac)`` tokens
    per size instead of ``sum(D)``. ``schedule: cosine`` trains each point as its own run (linear
    warmup over ``warmup_frac``, cosine to ``lr * min_lr_ratio``), as Chinchilla prescribes.

    **Learning rate per width.** ``lr`` applies at width ``lr_ref_width`` (None: the smallest
    ``d_model`` of ``sizes``); a rung of width d trains at ``lr * (lr_ref_width / d) **
    lr_width_exponent`` (0 = one lr for all). ``scalelab lr-sweep`` measures the best lr at the
    smallest and largest size and writes both fields into params/training.yaml.

    **Seeds.** ``seed`` sets a run's initialisation (``build_model``) and data order
    (``WindowSampler``). ``seeds`` lists extra seeds: each trains the ladder's points again with
    ``seed`` replaced, so a data intervention's effect can be set against seed-to-seed noise.
    ``seed_sizes`` (size tags such as ``d48_l2``, :attr:`ModelShape.tag`) limits the extra seeds to
    those sizes (empty: every size); under WSD a seed covers a whole size, its stable run and every
    cooldown branch. Extra-seed runs are reported beside the ladder (``reports/train_seeds.csv``),
    never in it, so the fits see one run per point.

    **Extra annealed points.** ``extra_branches`` (fractions f in (0, 1), ``schedule: wsd`` only):
    every ladder point of D tokens also gets a cooldown branch at ``f * D`` tokens from its size's
    stable run (:func:`tasks.training.design.anneal_points`) -- more properly annealed (N, D)
    points for the laws at the cost of their cooldowns only, since the stable run already passes
    their branch points. They carry no ``compute_budget`` and ``point: anneal`` in train.csv, so the
    per-budget comparisons and the downstream stages leave them out.

    **Architecture arms.** ``arch_compare`` names data variants also trained with the other
    architecture (``xlstm`` when ``arch: llama`` and vice versa), reported as ``<variant>+<arch>``
    (``raw+xlstm``) on the same points, data, steps and seed, as ``repb.compare``'s arms
    (:func:`tasks.training.arms.training_arms`).

    **Feasibility.** ``feasibility`` (:class:`FeasibilityConfig`) says what happens to a variant whose
    tokens cannot hold its ladder or the later stages' windows; it decides which points train, never
    what a run is, so it is left out of model folders' keys and runs' fingerprints.
    """

    vocab_size: int = 4096  # the tokenizer's size; the tokenizer is trained to exactly this
    seq_len: int = 128
    # A list, not a name->shape mapping: presets replace lists whole but merge mappings key by key.
    # Each rung is named by its shape tag (d64_l2).
    sizes: tuple[ModelShape, ...]
    token_budgets: tuple[int, ...] = ()
    compute_budgets: tuple[float, ...] = ()  # IsoFLOP design instead of token_budgets (FLOPs)
    sizes_per_budget: int = 3
    tokens_per_param_guess: float = 20.0  # where each budget's sizes are centred (Chinchilla's ~20)
    schedule: Literal["wsd", "cosine"] = "cosine"
    cooldown_frac: float = 0.2
    cooldown_shape: Literal["linear", "1-sqrt"] = "linear"
    warmup_steps: int | None = None  # wsd: None = warmup_frac of the ladder's shortest run
    lr_ref_width: int | None = None
    lr_width_exponent: float = 0.0
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
    seeds: tuple[int, ...] = ()  # extra training seeds, each a whole re-run of its sizes; empty: none
    seed_sizes: tuple[str, ...] = ()  # size tags the extra seeds train; empty: every size
    compile: bool = False  # torch.compile the model (worth it on GPU for the larger rungs)
    # torch intra-op threads of each training process (set once per process by the train flow or
    # a Ray worker, never toggled inside a task); 0 leaves torch's setting.
    # Tiny models on a busy 2-core machine run several times faster on 1 thread.
    num_threads: int = 0
    variants: tuple[str, ...] = ()  # curated variants to train; empty = every variant
    extra_branches: tuple[float, ...] = ()  # wsd: a cooldown branch at f * D per ladder point; empty: none
    arch_compare: tuple[str, ...] = ()  # variants also trained with the other arch, as <variant>+<arch>
    repb: RePBConfig = field(default_factory=RePBConfig)
    # which variants and points are trained when the data is short (not part of any run's numbers)
    feasibility: FeasibilityConfig = field(default_factory=FeasibilityConfig)
    # Scale-out of one point (tasks/training/distributed.py): W worker processes share each optimizer
    # step's global batch of batch_size * grad_accum sequences, each rank grad_accum / W micro-batches,
    # so the batch, lr schedule and branches -- and the result, up to float summation order -- do
    # not depend on W. Execution knobs: left out of the run's fingerprint and folder key.
    workers_per_point: int = 1
    gpus_per_worker: int = 0  # 0: CPU workers (gloo); 1: one GPU per worker process (nccl)
    parallel: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 shards weights and AdamW state over the W workers

    def __post_init__(self) -> None:
        require(self.vocab_size >= 256, "vocab_size", f"must be >= 256 (byte-level BPE), got {self.vocab_size}")
        at_least(self.seq_len, 2, "seq_len")
        require(len(self.sizes) > 0, "sizes", "needs at least one model shape")
        require(all(isinstance(s, ModelShape) for s in self.sizes), "sizes",
                "every item must be a ModelShape")
        tags = [s.tag for s in self.sizes]
        require(len(set(tags)) == len(tags), "sizes", f"two sizes share a d_model/n_layers tag: {tags}")
        require(bool(self.token_budgets) != bool(self.compute_budgets), "token_budgets",
                "set exactly one of token_budgets (a sizes x tokens grid) and compute_budgets (an IsoFLOP "
                f"design); got token_budgets={self.token_budgets}, compute_budgets={self.compute_budgets}")
        require(all(t > 0 for t in self.token_budgets), "token_budgets", f"must be positive, got {self.token_budgets}")
        require(len(set(self.token_budgets)) == len(self.token_budgets), "token_budgets",
                f"has duplicates: {self.token_budgets}")
        require(all(c > 0 and math.isfinite(c) for c in self.compute_budgets), "compute_budgets",
                f"must be positive finite FLOPs, got {self.compute_budgets}")
        require(len(set(self.compute_budgets)) == len(self.compute_budgets), "compute_budgets",
                f"has duplicates: {self.compute_budgets}")
        require(not self.compute_budgets or 1 <= self.sizes_per_budget <= len(self.sizes), "sizes_per_budget",
                f"must be in [1, len(sizes)={len(self.sizes)}], got {self.sizes_per_budget}")
        require(self.tokens_per_param_guess > 0, "tokens_per_param_guess",
                f"must be positive, got {self.tokens_per_param_guess}")
        require(self.schedule in ("wsd", "cosine"), "schedule", f"must be 'wsd' or 'cosine', got {self.schedule!r}")
        require(0.0 < self.cooldown_frac <= 1.0, "cooldown_frac", f"must be in (0, 1], got {self.cooldown_frac}")
        require(self.cooldown_shape in ("linear", "1-sqrt"), "cooldown_shape",
                f"must be 'linear' or '1-sqrt', got {self.cooldown_shape!r}")
        require(self.warmup_steps is None or self.warmup_steps >= 0, "warmup_steps",
                f"must be >= 0 or null, got {self.warmup_steps}")
        require(self.lr_ref_width is None or self.lr_ref_width > 0, "lr_ref_width",
                f"must be positive or null, got {self.lr_ref_width}")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.grad_accum, 1, "grad_accum")
        positive(self.lr, "lr")
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(0.0 <= self.warmup_frac < 1.0, "warmup_frac", f"must be in [0, 1), got {self.warmup_frac}")
        at_least(self.weight_decay, 0, "weight_decay")
        require(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"must be in [0, 1), got {self.betas}")
        require(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")
        at_least(self.eval_interval, 1, "eval_interval")
        require(self.eval_tokens > self.seq_len, "eval_tokens",
                f"must exceed seq_len {self.seq_len} (at least one window), got {self.eval_tokens}")
        at_least(self.log_interval, 1, "log_interval")
        require(self.checkpoint_interval >= 0, "checkpoint_interval",
                f"must be >= 0 (0 disables), got {self.checkpoint_interval}")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0 = torch's default), got {self.num_threads}")
        require(len(set(self.variants)) == len(self.variants), "variants", f"has duplicates: {self.variants}")
        require(all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.seeds), "seeds",
                f"must be non-negative integers (numpy seeds), got {self.seeds}")
        require(len(set(self.seeds)) == len(self.seeds), "seeds", f"has duplicates: {self.seeds}")
        require(self.seed not in self.seeds, "seeds",
                f"lists {self.seed}, which is `seed` (the base run); extra seeds must differ from it")
        require(len(set(self.seed_sizes)) == len(self.seed_sizes), "seed_sizes", f"has duplicates: {self.seed_sizes}")
        unknown = [t for t in self.seed_sizes if t not in tags]
        require(not unknown, "seed_sizes", f"names {unknown[:1]}, not a size of the ladder; sizes are {tags}")
        require(not self.seed_sizes or bool(self.seeds), "seed_sizes",
                f"is {list(self.seed_sizes)} but seeds is empty: extra seeds that cover no point; "
                "add seeds or clear seed_sizes")
        require(all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f < 1.0
                    for f in self.extra_branches), "extra_branches",
                f"fractions of each point's tokens must lie in (0, 1), got {list(self.extra_branches)}")
        require(len(set(self.extra_branches)) == len(self.extra_branches), "extra_branches",
                f"has duplicates: {list(self.extra_branches)}")
        require(not self.extra_branches or self.schedule == "wsd", "extra_branches",
                f"branches from a stable run need schedule: wsd, got {self.schedule!r}; clear extra_branches")
        require(len(set(self.arch_compare)) == len(self.arch_compare), "arch_compare",
                f"has duplicates: {list(self.arch_compare)}")
        at_least(self.workers_per_point, 1, "workers_per_point")
        require(self.gpus_per_worker in (0, 1), "gpus_per_worker",
                f"must be 0 (CPU workers) or 1 (one process drives one GPU; set workers_per_point to the GPU "
                f"count instead), got {self.gpus_per_worker}")
        require(self.parallel in ("ddp", "fsdp"), "parallel", f"must be 'ddp' or 'fsdp', got {self.parallel!r}")
        require(self.grad_accum % self.workers_per_point == 0, "workers_per_point",
                f"the global batch of batch_size x grad_accum = {self.batch_size} x {self.grad_accum} sequences "
                f"is not divisible by workers_per_point x batch_size = {self.workers_per_point} x "
                f"{self.batch_size}; make grad_accum a multiple of {self.workers_per_point} (and divide "
                "batch_size to keep the global batch)")
        require(self.workers_per_point == 1 or not (self.repb.enabled or self.repb.compare), "workers_per_point",
                f"is {self.workers_per_point}, but RePB (repb.enabled / repb.compare) selects over a whole "
                "step's samples on one process; train RePB arms with workers_per_point: 1")

    @property
    def other_arch(self) -> str:
        """The architecture ``arch_compare``'s arms train: ``xlstm`` for ``llama`` and vice versa."""
        return "xlstm" if self.arch == "llama" else "llama"

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def lr_for(self, shape: ModelShape) -> float:
        """The peak learning rate of a rung: ``lr * (lr_ref_width / d_model) ** lr_width_exponent``."""
        ref = self.lr_ref_width if self.lr_ref_width is not None else min(s.d_model for s in self.sizes)
        return self.lr * (ref / shape.d_model) ** self.lr_width_exponent
