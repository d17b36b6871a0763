"""Logit distillation losses and a short recovery loop for pruned (or otherwise compressed) students.

Every loss takes student and teacher logits ``(B, T, V)`` and an optional mask ``(B, T)`` (1 = the
position counts) and returns the mean over counted positions of a per-position loss:

* :func:`forward_kl` — ``KL(p_T || p_S) = Σ_v p_T(v) (log p_T(v) - log p_S(v))`` (Hinton, Vinyals &
  Dean 2015, "Distilling the Knowledge in a Neural Network", arXiv:1503.02531;
  temperature ``τ`` divides both logits and the loss is scaled by ``τ²``).
* :func:`direct_logit_distillation` (DLD) — ``(1/V) Σ_v (s_v - t_v)²``, the MSE between logits.
  Not shift-invariant: a student whose logits are the teacher's plus a constant (the same
  distribution) still pays ``c²``.
* :func:`concrete_score_distillation` (CSD; Kim, Shin, Kang, Na & Moon, "Distillation of Large Language
  Models via Concrete Score Matching", ICLR 2026, arXiv:2509.25837) — matches the relative logit differences over all vocabulary
  pairs, i.e. the log concrete scores ``log p(j)/p(i) = f[j] - f[i]``::

      L = ½ Σ_i Σ_j w_ij ((s_j - s_i) - (t_j - t_i))²,   w_ij = a_i b_j

  computed in O(V) per position (see :func:`concrete_score_distillation`). Zero exactly when the
  student's logits are the teacher's up to a per-position shift.

:func:`recover` runs a few AdamW steps of one of them on token windows and returns the loss curve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require
from tasks.lm.windows import token_windows as common_token_windows

LOSSES = ("csd", "kl", "dld")
WEIGHT_SOURCES = ("student", "teacher", "uniform")
CSD_WEIGHTINGS: dict[str, tuple[str, str]] = {
    "mode_seeking": ("student", "student"),
    "mode_covering": ("teacher", "student"),
}
"""The two CSD instances by name: ``(a, b)`` in ``w_ij = a_i b_j`` (see :func:`concrete_score_distillation`)."""


def csd_weighting(weighting: str | tuple[str, str]) -> tuple[str, str]:
    """``(a, b)`` for a CSD weighting: a name in :data:`CSD_WEIGHTINGS`, ``"a/b"`` (e.g.
    ``"uniform/student"``) or a pair, each of ``student``, ``teacher``, ``uniform``."""
    if isinstance(weighting, str):
        pair = CSD_WEIGHTINGS.get(weighting) or tuple(weighting.split("/"))
    else:
        pair = tuple(weighting)
    if len(pair) != 2 or any(p not in WEIGHT_SOURCES for p in pair):
        raise ValueError(f"weighting: {weighting!r} is not one of {list(CSD_WEIGHTINGS)} nor a pair 'a/b' "
                         f"of {list(WEIGHT_SOURCES)}")
    return pair[0], pair[1]


def _masked_mean(per_position: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return per_position.mean()
    if mask.shape != per_position.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match the logits' positions {tuple(per_position.shape)}")
    m = mask.to(per_position.dtype)
    return (per_position * m).sum() / m.sum().clamp_min(1.0)


def _check(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher_logits: shape {tuple(teacher_logits.shape)} differs from the student's "
                         f"{tuple(student_logits.shape)} (distillation needs a shared vocabulary)")


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None, *,
               temperature: float = 1.0) -> torch.Tensor:
    """``τ² KL(softmax(t/τ) || softmax(s/τ))`` per position, masked mean. Logits (B, T, V) (any leading dims)."""
    _check(student_logits, teacher_logits)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    return _masked_mean(kl, mask) * temperature**2


def direct_logit_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                              mask: torch.Tensor | None = None) -> torch.Tensor:
    """DLD: ``(1/V) Σ_v (s_v - t_v)²`` per position, masked mean."""
    _check(student_logits, teacher_logits)
    return _masked_mean((student_logits.float() - teacher_logits.float()).pow(2).mean(-1), mask)


def _weights(source: str, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """A probability vector over the vocabulary per position, without gradient."""
    if source == "student":
        return F.softmax(student.detach(), dim=-1)
    if source == "teacher":
        return F.softmax(teacher.detach(), dim=-1)
    return torch.full_like(student.detach(), 1.0 / student.shape[-1])


def concrete_score_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                mask: torch.Tensor | None = None, *,
                                weighting: str | tuple[str, str] = "mode_seeking") -> torch.Tensor:
    """Concrete Score Distillation in O(V) per position (Kim et al., ICLR 2026), masked mean over positions.

    With ``d = s - t`` (student minus teacher logits at one position) and weights ``w_ij = a_i b_j``::

        L = ½ Σ_i Σ_j a_i b_j (d_i - d_j)²
          = ½ [ (Σ_j b_j) Σ_i a_i d_i²  +  (Σ_i a_i) Σ_j b_j d_j²  -  2 (Σ_i a_i d_i)(Σ_j b_j d_j) ]

    since ``(s_j - s_i) - (t_j - t_i) = d_j - d_i``. ``a`` and ``b`` are distributions (sums 1), so
    ``L = ½ [E_a d² + E_b d² - 2 E_a d · E_b d]``; for ``a = b = p`` it is ``Var_p(d)``. ``d`` is
    centred by ``E_a d`` first (the pairwise form is exactly invariant to a per-position shift of
    ``d``), which keeps the three terms from cancelling catastrophically.

    Weightings (``weighting``; :data:`CSD_WEIGHTINGS`), as in the authors' public code
    (aailab-kaist/CSD, ``csd`` and ``csd_weighting_function``):

    * ``mode_seeking`` = (S, S): ``a = b = p_S`` — the student's own distribution decides which
      pairs count, as reverse KL does; the paper's default, highest fidelity.
    * ``mode_covering`` = (T, S): ``a = p_T``, ``b = p_S`` — every pair involving a token the teacher
      puts mass on counts, so the student is pulled towards the teacher's modes it misses.
    * any pair ``"a/b"`` of ``student``, ``teacher``, ``uniform`` (``uniform/uniform`` is DLD on
      mean-centred logits).

    Where we had to choose: the weights carry no gradient (stop-gradient, as the authors' code does;
    a student-weighted loss with gradient through its weights could lower itself by moving mass to
    where it already agrees). The scale is the paper's ``½ Σ_ij`` (the authors' code computes a
    surrogate whose gradient is half of this one's). The paper's own text for the mode-covering
    instance was not available to us: (T, S) is the teacher-weighted variant the authors' code
    ships; (T, T) — the pure teacher weighting — is ``weighting="teacher/teacher"``; it gives no
    gradient to tokens the teacher assigns no mass, whatever the student puts there.

    >>> s = torch.randn(2, 3, 50); concrete_score_distillation(s + 4.0, s)   # a shift costs nothing  # doctest: +SKIP
    tensor(0.)
    """
    _check(student_logits, teacher_logits)
    wa, wb = csd_weighting(weighting)
    s, t = student_logits.float(), teacher_logits.float()
    a, b = _weights(wa, s, t), _weights(wb, s, t)
    d = s - t
    d = d - (a * d).sum(-1, keepdim=True).detach()
    a_sum, b_sum = a.sum(-1), b.sum(-1)
    ad, bd = (a * d).sum(-1), (b * d).sum(-1)
    per_position = 0.5 * (b_sum * (a * d * d).sum(-1) + a_sum * (b * d * d).sum(-1) - 2.0 * ad * bd)
    return _masked_mean(per_position, mask)


def concrete_score_distillation_pairwise(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                         mask: torch.Tensor | None = None, *,
                                         weighting: str | tuple[str, str] = "mode_seeking") -> torch.Tensor:
    """The definition of :func:`concrete_score_distillation`, summed over all (i, j) pairs: O(V²)
    memory and time, for checking the O(V) form on small vocabularies."""
    _check(student_logits, teacher_logits)
    wa, wb = csd_weighting(weighting)
    s, t = student_logits.double(), teacher_logits.double()
    a, b = _weights(wa, s, t), _weights(wb, s, t)
    rel_s = s.unsqueeze(-2) - s.unsqueeze(-1)  # [..., i, j] = s_j - s_i
    rel_t = t.unsqueeze(-2) - t.unsqueeze(-1)
    w = a.unsqueeze(-1) * b.unsqueeze(-2)
    return _masked_mean(0.5 * (w * (rel_s - rel_t).pow(2)).sum((-2, -1)), mask)


# ---------------------------------------------------------------------------------------------
# Recovery


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """A short distillation run. ``loss``: ``csd``, ``kl`` (forward KL) or ``dld``; ``weighting``:
    the CSD weighting (``mode_seeking``, ``mode_covering`` or ``a/b``); ``temperature``: KL's ``τ``.
    ``steps`` AdamW steps (``lr``, ``weight_decay``, gradient norm clipped at ``max_grad_norm``,
    0 = no clipping) on batches of ``batch_size`` windows of ``seq_len`` tokens (used when the
    tokens come as a 1-D stream), drawn in a shuffled order fixed by ``seed``, reshuffled each pass."""

    loss: Literal["csd", "kl", "dld"] = "csd"
    weighting: str = "mode_seeking"
    temperature: float = 1.0
    steps: int = 20
    lr: float = 5e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_size: int = 4
    seq_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.loss in LOSSES, "loss", f"must be one of {list(LOSSES)}, got {self.loss!r}")
        try:
            csd_weighting(self.weighting)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        at_least(self.steps, 1, "steps")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        at_least(self.weight_decay, 0, "weight_decay")
        require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.seq_len, 2, "seq_len")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None,
                      cfg: DistillConfig) -> torch.Tensor:
    """The loss ``cfg.loss`` of logits (B, T, V) under ``mask`` (B, T)."""
    if cfg.loss == "csd":
        return concrete_score_distillation(student_logits, teacher_logits, mask, weighting=cfg.weighting)
    if cfg.loss == "kl":
        return forward_kl(student_logits, teacher_logits, mask, temperature=cfg.temperature)
    return direct_logit_distillation(student_logits, teacher_logits, mask)


@dataclass
class RecoveryCurve:
    """``losses[k]``: the distillation loss of step ``k``'s batch before its update; ``tokens``:
    tokens the student was trained on; ``seconds``: wall time of the loop, evaluations included.
    ``evals``: ``(step, tokens trained on, score)`` where :func:`recover` was given ``evaluate``."""

    loss: str
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    evals: list[tuple[int, int, float]] = field(default_factory=list)


def token_windows(tokens: np.ndarray | torch.Tensor, seq_len: int) -> torch.Tensor:
    """(n, T) int64 windows (:func:`tasks.lm.windows.token_windows`), at least one of at least 2 tokens."""
    windows = common_token_windows(tokens, seq_len)
    if windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"tokens: no window of at least 2 tokens (shape {tuple(np.shape(tokens))}, seq_len {seq_len})")
    return windows


def recover(student: nn.Module, teacher: nn.Module, tokens: np.ndarray | torch.Tensor, cfg: DistillConfig, *,
            evaluate: Callable[[nn.Module], float] | None = None, every: int = 0,
            initial: float | None = None) -> RecoveryCurve:
    """Train ``student`` in place for ``cfg.steps`` AdamW steps to match ``teacher``'s logits on ``tokens``.

    ``tokens``: (n, T) windows or a 1-D stream (cut into ``cfg.seq_len`` windows). Every position's
    next-token distribution is distilled (mask of ones). The teacher runs without gradient; the
    student's train/eval mode is restored afterwards. Both models must share the vocabulary.

    The recovery curve: with ``evaluate`` (e.g. validation perplexity; it must leave the student's
    weights alone), ``curve.evals`` gets ``evaluate(student)`` before the first step (``initial``
    instead, when the caller already has that score), after every ``every``-th step (0 = none
    between) and after the last. The training itself is the same with or without it.

    >>> curve = recover(pruned.model, model, train_windows, DistillConfig(loss="csd", steps=10))  # doctest: +SKIP
    >>> curve.losses[0] > curve.losses[-1]                                                         # doctest: +SKIP
    True
    """
    if every < 0:
        raise ValueError(f"every: must be >= 0 (0 = only before the first and after the last step), got {every}")
    windows = token_windows(tokens, cfg.seq_len)
    device = next(student.parameters()).device
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("student: has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.empty(0, dtype=torch.long)
    curve = RecoveryCurve(loss=cfg.loss)
    was_training = student.training
    teacher.eval()
    student.train()
    start = time.perf_counter()
    if evaluate is not None:
        curve.evals.append((0, 0, float(evaluate(student) if initial is None else initial)))
    try:
        for step in range(1, cfg.steps + 1):
            if len(order) < min(cfg.batch_size, len(windows)):
                order = torch.cat([order, torch.randperm(len(windows), generator=gen)])
            idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
            x = windows[idx].to(device)
            with torch.no_grad():
                t_logits = teacher(input_ids=x, use_cache=False).logits
            s_logits = student(input_ids=x, use_cache=False).logits
            loss = distillation_loss(s_logits, t_logits, None, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            curve.losses.append(float(loss.detach()))
            curve.tokens += x.numel()
            if evaluate is not None and (step == cfg.steps or (every and step % every == 0)):
                curve.evals.append((step, curve.tokens, float(evaluate(student))))
                student.train()
    finally:
        student.train(was_training)
    curve.seconds = time.perf_counter() - start
    return curve
