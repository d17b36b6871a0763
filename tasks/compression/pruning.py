"""The prune stage's config and its per-model work: prune, score, recover by distillation, score again.

A setting of ``params/pruning.yaml`` names a registered pruning method (:data:`PRUNERS`:
``entrodrop``, ``cosine_drop``, ...) and its fields::

    pruning:
      settings:
        entrodrop_l1: {method: entrodrop, n_remove: 1, granularity: layer}
      recovery:
        losses: [csd, kl]        # one distillation run per loss from the same pruned model
        steps: 20

:func:`prune_rows` runs every setting on one model and returns one row for the dense model, one for
each pruned model before recovery (``recovery_loss = "none"``) and one per recovery loss, each with
validation perplexity, parameter count and forward FLOPs per token (:func:`forward_flops_per_token`).
The teacher of every recovery run is the unpruned model, whose logits on the recovery batches are
computed once and shared by every run (:class:`CachedTeacher`), so losses differ only in the loss.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from tasks.common.config import at_least, in_interval, require, to_dict
from tasks.common.io import atomic_path
from tasks.common.patterns import matches_any
from tasks.common.registry import MethodSpec
from tasks.compression.distill import LOSSES, DistillConfig, recover, token_windows
from tasks.compression.paser import PaserConfig, paser_select, random_select, sample_degradation
from tasks.compression.registry import PRUNERS
from tasks.lm.embeddings import question_embeddings
from tasks.lm.loss import evaluate_loss, perplexity
from tasks.zoo.models import PRETRAINED_MODELS

# The recovery losses a params file may name: (distill loss, CSD weighting).
RECOVERY_LOSSES = {"csd": ("csd", "mode_seeking"), "csd_cover": ("csd", "mode_covering"),
                   "kl": ("kl", "mode_seeking"), "dld": ("dld", "mode_seeking")}
assert {kind for kind, _ in RECOVERY_LOSSES.values()} <= set(LOSSES)
DATA_SELECTORS = ("random", "paser")


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """Distillation after pruning. ``losses``: one run per entry of :data:`RECOVERY_LOSSES` (``csd``
    is the mode-seeking instance, ``csd_cover`` the mode-covering one; empty = no recovery).
    ``steps`` AdamW steps at ``lr`` on batches of ``batch_size`` windows of ``seq_len`` tokens drawn
    from the first ``tokens`` training tokens after the calibration ones. ``train_embeddings``:
    also train the (often tied) embeddings and head; off by default, as in the benchmark (a fifth of
    SmolLM2's weights, and the head's gradient is a third of the backward).

    ``data_select``: how the recovery windows are chosen from the candidates (the ``tokens`` cut
    into ``seq_len`` windows): ``random`` or ``paser`` (:mod:`tasks.compression.paser`, configured
    by ``paser``), each taking ``budget`` of the candidate windows. The first entry runs with every
    loss; the others with the first loss only, which is what comparing selectors at equal loss
    needs. A second selector needs ``budget < 1`` (at 1 every selector takes every window).

    ``compare_settings``: the settings on which the comparisons run, i.e. the losses after the
    first and the selectors after the first; every other setting is recovered once, by the first
    loss on the first selector's windows (empty = compare on every setting), since a PASER selection
    and each recovery run cost time on every setting (docs/pruning.md).

    ``curve_every``: the recovery curve's validation perplexity is taken before the first step,
    after every ``curve_every``-th step and after the last; 0 = only those two ends, which the rows
    score anyway (each point between costs one more evaluation of the student)."""

    losses: tuple[str, ...] = ("csd", "kl")
    data_select: tuple[str, ...] = ("random",)
    compare_settings: tuple[str, ...] = ()
    budget: float = 1.0
    paser: PaserConfig = field(default_factory=PaserConfig)
    steps: int = 20
    lr: float = 1e-4
    batch_size: int = 4
    seq_len: int = 128
    tokens: int = 16384
    train_embeddings: bool = False
    curve_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [x for x in self.losses if x not in RECOVERY_LOSSES]
        require(not bad, "losses", f"unknown loss(es) {bad}; choose from {list(RECOVERY_LOSSES)}")
        require(len(set(self.losses)) == len(self.losses), "losses", f"has duplicates: {list(self.losses)}")
        at_least(self.steps, 1, "steps")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.seq_len, 2, "seq_len")
        require(self.tokens >= self.seq_len, "tokens", f"must be >= seq_len ({self.seq_len}), got {self.tokens}")
        bad = [x for x in self.data_select if x not in DATA_SELECTORS]
        require(not bad and len(self.data_select) > 0, "data_select",
                f"must name one or more of {list(DATA_SELECTORS)}, got {list(self.data_select)}")
        require(len(set(self.data_select)) == len(self.data_select), "data_select", f"has duplicates: {list(self.data_select)}")
        in_interval(self.budget, 0, 1, "budget", "(]")
        require(len(self.data_select) == 1 or self.budget < 1, "budget",
                f"must be < 1 to compare selectors {list(self.data_select)} (at 1 each takes every window)")
        require(self.curve_every >= 0, "curve_every",
                f"must be >= 0 (0 = the curve's two ends only), got {self.curve_every}")

    def runs(self, setting: str | None = None) -> list[tuple[str, str]]:
        """``(loss, data_select)`` pairs: the first selector with every loss, the others with the first
        loss; on a ``setting`` that ``compare_settings`` leaves out, the first pair only."""
        if not self.losses:
            return []
        first, *others = self.data_select
        if setting is not None and self.compare_settings and setting not in self.compare_settings:
            return [(self.losses[0], first)]
        return [(loss, first) for loss in self.losses] + [(self.losses[0], d) for d in others]

    def distill(self, loss: str) -> DistillConfig:
        kind, weighting = RECOVERY_LOSSES[loss]
        return DistillConfig(loss=kind, weighting=weighting, steps=self.steps, lr=self.lr,
                             batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed)


SAVE_LADDER = ("largest", "all", "none")


@dataclass(frozen=True, kw_only=True)
class SaveConfig:
    """Which pruned models the prune stage keeps for the evaluate stage (``models/pruned/``).

    ``rows``: shell patterns on a row's name, ``<setting>`` for a pruned model before recovery and
    ``<setting>+<loss>+<select>`` after (``"*+csd+random"``: every setting recovered by CSD on
    random windows); empty = none. ``ladder``: whose rows, ``largest`` (the pruned ladder model
    with the most parameters; the first in variant order on a tie), ``all`` or ``none``;
    ``pretrained``: also the pretrained models' (SmolLM2: ~0.5 GB each in float32)."""

    rows: tuple[str, ...] = ("*+csd+random",)
    ladder: str = "largest"
    pretrained: bool = False

    def __post_init__(self) -> None:
        require(self.ladder in SAVE_LADDER, "ladder", f"must be one of {list(SAVE_LADDER)}, got {self.ladder!r}")

    def keeps(self, row_name: str) -> bool:
        """Whether the row named ``row_name`` (``entrodrop_l1`` or ``entrodrop_l1+csd+random``) is kept."""
        return matches_any(row_name, self.rows)


@dataclass(frozen=True, kw_only=True)
class PruningConfig:
    """The ``pruning:`` section of params/pruning.yaml.

    ``settings``: named pruning entries (``{method: entrodrop, n_remove: 1, ...}``), checked against
    each method's config class; ``enabled``: the settings to run (empty = all). ``models``: trained
    runs by name (empty = the largest run of each variant, ``largest_only``; false = all runs).
    ``calib_tokens``: training tokens the methods score blocks on; ``eval_tokens`` validation tokens
    scored per model at ``seq_len`` (None = the model's training length) in batches of ``batch_size``.
    ``recovery``: :class:`RecoveryConfig`. ``save``: :class:`SaveConfig`, the pruned models kept for
    the evaluate stage. ``pretrained`` (``smollm2``) with ``pretrained_settings``
    (empty = the enabled ones), its own ``pretrained_*`` token counts, window length, recovery (None =
    ``recovery``) and torch threads (``pretrained_num_threads``: it runs after the ladder's models, alone).
    """

    settings: dict[str, dict[str, Any]]
    enabled: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    # trained series whose models this stage works on (e.g. [raw, dedup_gopher]); empty = every trained series
    variants: tuple[str, ...] = ()
    largest_only: bool = True
    calib_tokens: int = 4096
    eval_tokens: int = 32768
    seq_len: int | None = None
    batch_size: int = 16
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    pretrained: tuple[str, ...] = ()
    pretrained_settings: tuple[str, ...] = ()
    pretrained_calib_tokens: int = 2048
    pretrained_eval_tokens: int = 8192
    pretrained_seq_len: int = 256
    pretrained_batch_size: int = 4
    pretrained_recovery: RecoveryConfig | None = None
    num_threads: int = 1
    pretrained_num_threads: int = 2

    def __post_init__(self) -> None:
        require(len(self.settings) > 0, "settings", "needs at least one setting")
        PRUNERS.validate_section(self.settings, self.enabled)
        missing = [n for n in self.pretrained_settings if n not in self.settings]
        require(not missing, "pretrained_settings", f"names settings that are not defined: {missing}")
        for key, rc in (("recovery", self.recovery), ("pretrained_recovery", self.pretrained_recovery)):
            missing = [n for n in (rc.compare_settings if rc else ()) if n not in self.settings]
            require(not missing, f"{key}.compare_settings", f"names settings that are not defined: {missing}")
        unknown = [p for p in self.pretrained if p not in PRETRAINED_MODELS]
        require(not unknown, "pretrained", f"unknown pretrained model(s) {unknown}; known: {list(PRETRAINED_MODELS)}")
        for key in ("calib_tokens", "pretrained_calib_tokens"):
            require(getattr(self, key) >= 2, key, f"must be >= 2, got {getattr(self, key)}")
        for key in ("eval_tokens", "pretrained_eval_tokens", "pretrained_seq_len"):
            require(getattr(self, key) >= 2, key, f"must be >= 2, got {getattr(self, key)}")
        require(self.seq_len is None or self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.pretrained_batch_size, 1, "pretrained_batch_size")
        require(len(set(self.models)) == len(self.models), "models", f"has duplicates: {list(self.models)}")
        for key in ("num_threads", "pretrained_num_threads"):
            require(getattr(self, key) >= 0, key, f"must be >= 0 (0 = torch's default), got {getattr(self, key)}")

    def methods(self, pretrained: bool = False) -> dict[str, tuple[str, MethodSpec]]:
        """The settings to run as ``{setting: (method, cfg)}`` (on pretrained models: ``pretrained_settings``)."""
        parsed = PRUNERS.parse_settings(self.settings, prefix="pruning.settings")
        names = (self.pretrained_settings if pretrained else ()) or self.enabled or tuple(parsed)
        return {n: parsed[n] for n in names}


def prune(model: nn.Module, cfg: MethodSpec, *, calib_tokens: np.ndarray | torch.Tensor | None) -> Any:
    """Run pruning method ``cfg.method`` on ``model`` (left unchanged); the result has ``.model`` and ``.meta()``."""
    return PRUNERS.get(cfg.method).fn(model, cfg, calib_tokens=calib_tokens)


def matmul_params(model: nn.Module) -> int:
    """Weights that multiply activations per token: every ``nn.Linear`` (the output head included, once
    when tied) and every InherNet up factor (``InherLinear.up``, all heads run), not the embedding lookup."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        weights = [m.weight] if isinstance(m, nn.Linear) else []
        if isinstance(getattr(m, "up", None), nn.Parameter):
            weights.append(m.up)
        for w in weights:
            if id(w) not in seen:
                seen.add(id(w))
                total += w.numel()
    return total


def forward_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token at context ``seq_len``: ``2 * matmul_params + 4 * L_attn * seq_len * d_attn``.

    The forward third of the training convention in params/training.yaml (PaLM's ``6N + 12 L T d``),
    with ``L_attn`` the attention blocks still present (a removed attention sub-block costs nothing)
    and ``d_attn`` each one's query width (``o_proj``'s input features).
    """
    attn = 0
    for m in model.modules():
        o_proj = getattr(m, "o_proj", None)
        if isinstance(o_proj, nn.Module) and hasattr(o_proj, "in_features"):  # nn.Linear or InherLinear
            attn += o_proj.in_features
    return float(2 * matmul_params(model) + 4 * seq_len * attn)


def n_params(model: nn.Module) -> int:
    """Distinct parameters (tied tensors counted once)."""
    return int(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))


class CachedTeacher(nn.Module):
    """The teacher's logits per distinct batch, computed once: every recovery run from the same seed
    sees the same batches, so the second loss pays no teacher forward."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher
        self.cache: dict[tuple, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        key = (tuple(input_ids.shape), input_ids.cpu().numpy().tobytes())
        if key not in self.cache:
            with torch.no_grad():
                self.cache[key] = self.teacher(input_ids=input_ids, use_cache=False).logits
        return _Logits(self.cache[key])


@dataclass
class _Logits:
    logits: torch.Tensor


class PruneTables(NamedTuple):
    """What :func:`prune_rows` returns: ``rows`` (reports/pruning.csv) and ``curves`` (one row per
    point of each recovery run's curve, reports/pruning_recovery.csv)."""

    rows: list[dict[str, Any]]
    curves: list[dict[str, Any]]


def prune_rows(
    model: nn.Module, *, settings: dict[str, tuple[str, MethodSpec]], recovery: RecoveryConfig,
    calib: np.ndarray, train: np.ndarray, val: np.ndarray, seq_len: int, batch_size: int, eval_tokens: int,
    base_row: dict[str, Any],
    log: Callable[[str, dict[str, Any], dict[str, Any], list[dict[str, Any]]], None] | None = None,
    texts: Callable[[torch.Tensor], list[str]] | None = None,
    save: Callable[[str, nn.Module], str | None] | None = None,
) -> PruneTables:
    """Every setting on ``model``: the dense row, then per setting the pruned row and one row per
    recovery run (:meth:`RecoveryConfig.runs`), and each recovery run's perplexity curve.

    ``calib``: training tokens the methods score on; ``train``: the recovery candidates (disjoint
    from ``calib``), cut into ``recovery.seq_len`` windows; ``val``: validation tokens, of which the
    first ``eval_tokens`` are scored in windows of ``seq_len``. ``texts(windows)`` decodes windows
    for PASER's sentence embeddings (needed when ``recovery.data_select`` has ``paser``).

    A curve (``recovery.curve_every``) starts at the pruned row's perplexity (step 0) and ends at
    the recovered row's: the same evaluation, not a second one. Its rows carry the row's model
    columns, ``setting``, ``method``, ``removed_fraction``, ``recovery_loss``, ``data_select``,
    ``step``, ``recovery_tokens``, ``ppl`` and ``curve`` (one name per run, for plotting).

    ``log(name, params, metrics, curve)`` is called once per row (the stage's MLflow run; ``curve``
    is the run's curve rows, empty for the dense and pruned rows). ``save(name, model)`` is offered
    every pruned and recovered model (``name``: ``<setting>`` or ``<setting>+<loss>+<select>``) and
    returns where it kept it, recorded as the row's ``model_path`` (None: not kept) and passed to
    ``log`` in ``params`` (after ``save``, so the stage can log the kept model by reference).
    """

    def ppl(m: nn.Module) -> float:
        return perplexity(evaluate_loss(m, val, seq_len, batch_size, max_tokens=eval_tokens))

    dense_params = n_params(model)
    dense = {"setting": "dense", "method": "dense", "granularity": None, "removed": "", "removed_fraction": 0.0,
             "recovery_loss": "none", "data_select": "none", "recovery_steps": 0, "recovery_tokens": 0,
             "ppl": ppl(model), "params": dense_params, "flops_per_token": forward_flops_per_token(model, seq_len),
             "seconds": 0.0}
    rows = [base_row | dense]
    curves: list[dict[str, Any]] = []
    if log:
        log("dense", base_row | {"method": "dense"}, dense, [])
    windows = token_windows(np.asarray(train), recovery.seq_len)
    k = max(1, round(recovery.budget * len(windows)))
    embeddings = None
    if any(select == "paser" for setting in settings for _, select in recovery.runs(setting)):
        if texts is None:
            raise ValueError("recovery.data_select names paser, which needs the windows' text (texts=)")
        embeddings = question_embeddings(texts(windows))
    teacher = CachedTeacher(model)
    for setting, (method, cfg) in settings.items():
        t = time.perf_counter()
        result = prune(model, cfg, calib_tokens=calib)
        meta = result.meta()
        pruned = result.model.eval()
        params = n_params(pruned)
        row = base_row | {"setting": setting, "method": method, "granularity": meta.get("granularity"),
                          "removed": " ".join(map(str, meta.get("removed", []))),
                          "removed_fraction": 1.0 - params / dense_params, "params": params,
                          "flops_per_token": forward_flops_per_token(pruned, seq_len)}
        first = {"recovery_loss": "none", "data_select": "none", "recovery_steps": 0, "recovery_tokens": 0,
                 "ppl": ppl(pruned), "seconds": round(time.perf_counter() - t, 2)}
        kept = save(setting, pruned) if save else None
        rows.append(row | first | {"model_path": kept})
        if log:
            log(setting, row | {"config": to_dict(cfg), "model_path": kept}, first, [])
        runs = recovery.runs(setting)
        chosen = {d: select_windows(d, model, pruned, windows, k, recovery, embeddings)
                  for d in dict.fromkeys(select for _, select in runs)}
        for loss, select in runs:
            t = time.perf_counter()
            student = copy.deepcopy(pruned)
            if not recovery.train_embeddings:
                student.get_input_embeddings().weight.requires_grad_(False)
                student.get_output_embeddings().weight.requires_grad_(False)
            curve = recover(student, teacher, windows[chosen[select]], recovery.distill(loss), evaluate=ppl,
                            every=recovery.curve_every, initial=first["ppl"])
            name = f"{setting}+{loss}+{select}"
            rec = {"recovery_loss": loss, "data_select": select, "recovery_steps": recovery.steps,
                   "recovery_windows": len(chosen[select]), "recovery_tokens": curve.tokens,
                   "ppl": curve.evals[-1][2], "distill_loss_first": curve.losses[0],
                   "distill_loss_last": curve.losses[-1], "seconds": round(time.perf_counter() - t, 2)}
            points = [base_row | {"setting": setting, "method": method, "removed_fraction": row["removed_fraction"],
                                  "recovery_loss": loss, "data_select": select, "step": step,
                                  "recovery_tokens": tokens, "ppl": value,
                                  "curve": f"{base_row.get('variant', '')}/{base_row.get('model', '')}:{name}"}
                      for step, tokens, value in curve.evals]
            curves += points
            kept = save(name, student.eval()) if save else None
            rows.append(row | rec | {"model_path": kept})
            if log:
                log(name, row | {"recovery": to_dict(recovery), "model_path": kept}, rec, points)
            del student
        del result, pruned
    return PruneTables(rows, curves)


def select_windows(select: str, dense: nn.Module, pruned: nn.Module, windows: torch.Tensor, k: int,
                   recovery: RecoveryConfig, embeddings: np.ndarray | None) -> np.ndarray:
    """Indices of the ``k`` recovery windows ``select`` chooses (all of them at ``budget`` 1)."""
    if k >= len(windows):
        return np.arange(len(windows))
    if select == "random":
        return random_select(len(windows), k, recovery.seed).indices
    pc = recovery.paser
    degradation = sample_degradation(dense, pruned, windows, kind=pc.degradation, batch_size=pc.batch_size)
    lengths = np.full(len(windows), windows.shape[1])
    return paser_select(embeddings, degradation, lengths, k, pc).indices


def largest_per_variant(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run with the most parameters of each variant (ties: the most tokens), in variant order."""
    best: dict[str, dict[str, Any]] = {}
    for m in models:
        cur = best.get(m["variant"])
        if cur is None or (m["n_params"], m.get("tokens") or 0) > (cur["n_params"], cur.get("tokens") or 0):
            best[m["variant"]] = m
    return list(best.values())



def plot_recovery_curves(curves: list[dict[str, Any]], path: str | Path) -> None:
    """Validation perplexity against recovery tokens, one panel per pruned model (model and setting),
    one line per recovery run: colour = loss, line style = data selector. ``curves``: the
    ``curves`` of :func:`prune_rows` (several models' concatenated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, list[dict[str, Any]]] = {}
    for c in curves:
        panels.setdefault(f"{c.get('variant', '')}/{c.get('model', '')}: {c['setting']}", []).append(c)
    losses = list(RECOVERY_LOSSES)
    styles = {d: ls for d, ls in zip(DATA_SELECTORS, ("-", "--"))}
    n = max(1, len(panels))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, points) in zip(axes.flat, panels.items()):
        for name in dict.fromkeys(p["curve"] for p in points):
            run = sorted((p for p in points if p["curve"] == name), key=lambda p: p["step"])
            loss, select = run[0]["recovery_loss"], run[0]["data_select"]
            ax.plot([p["recovery_tokens"] for p in run], [p["ppl"] for p in run], marker="o", ms=3,
                    ls=styles.get(select, ":"), color=plt.cm.tab10(losses.index(loss) % 10), label=f"{loss}, {select}")
        ax.set_title(title, fontsize=9)
        ax.ticklabel_format(axis="y", useOffset=False)  # perplexities, not offsets from one
        ax.set_xlabel("recovery tokens", fontsize=8)
        ax.set_ylabel("validation perplexity", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
