"""Fine-tuning for DDCF's selections (Difficulty–Diversity Collaborative Filtering; public code
iNLP-Lab/DDCF): the loop that trains the target on a selection (and setting (a)'s pool models and
target from scratch).

The paper does not fix the fine-tuning; here it is AdamW on the answer tokens only (and the closing
end-of-text), with a WSD schedule (warmup, constant, linear cooldown), cycling through seeded
permutations of the selected questions for either the same number of steps for every selection
(equal compute) or the same number of epochs over it (``FinetuneConfig.schedule``). Questions
travel as :class:`EncodedQA` rows; setting (b) passes its own loss (the gold continuation given
the context).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.selection.config import FinetuneConfig


@dataclass(frozen=True)
class EncodedQA:
    """Right-padded (with EOS) question+answer+EOS rows: ``ids`` (n, T + 1) int64, ``target_mask``
    (n, T) bool marking the positions whose *next* token is an answer token or the closing EOS."""

    ids: torch.Tensor
    target_mask: torch.Tensor


def _answer_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits[mask].float(), ids[:, 1:][mask])


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def train_on_questions(model: nn.Module, sample: Callable[[int], EncodedQA], steps: int, *, lr: float,
                       cooldown_frac: float = 0.0, snapshots: Sequence[int] = (),
                       on_snapshot: Callable[[int, nn.Module], None] | None = None,
                       loss_fn: LossFn = _answer_loss) -> nn.Module:
    """AdamW (betas 0.9/0.95, no weight decay) on the answer tokens of ``sample(step)``'s batch:
    10% linear warmup, constant ``lr``, then a linear cooldown to 0 over the last ``cooldown_frac``
    of the steps (WSD, as the ladder); ``on_snapshot(step, model)`` after each step in ``snapshots``.
    ``loss_fn(model, ids, target_mask)``: mean cross-entropy of the masked next tokens.

    A target trained without a cooldown gains from any few low-lr steps whatever their data, which
    would credit a selection with the annealing; the target and every fine-tune therefore cool down.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    decay_start = steps - int(round(cooldown_frac * steps))
    marks = set(snapshots)
    model.train()
    for step in range(1, steps + 1):
        scale = min(1.0, step / warmup)
        if step > decay_start:
            scale = min(scale, (steps - step + 1) / (steps - decay_start + 1))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        batch = sample(step)
        loss = loss_fn(model, batch.ids, batch.target_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in marks and on_snapshot is not None:
            on_snapshot(step, model)
            model.train()
    model.eval()
    return model


def finetune_on(model: nn.Module, data: EncodedQA, cfg: FinetuneConfig, seed: int,
                loss_fn: LossFn = _answer_loss) -> nn.Module:
    """Fine-tune on the rows of ``data`` for :func:`finetune_steps` steps, cycling through seeded
    permutations of them."""
    n = data.ids.shape[0]
    rng = np.random.default_rng(seed)
    order: list[int] = []

    def sample(_: int) -> EncodedQA:
        while len(order) < cfg.batch_size:
            order.extend(rng.permutation(n).tolist())
        idx = torch.tensor(order[: cfg.batch_size])
        del order[: cfg.batch_size]
        return EncodedQA(ids=data.ids[idx], target_mask=data.target_mask[idx])

    return train_on_questions(model, sample, finetune_steps(cfg, n), lr=cfg.lr, cooldown_frac=cfg.cooldown_frac,
                              loss_fn=loss_fn)


def finetune_steps(cfg: FinetuneConfig, n: int) -> int:
    """Optimizer steps for a selection of ``n`` questions under ``cfg.schedule``."""
    if cfg.schedule == "steps":
        return cfg.steps
    return max(1, min(cfg.steps, math.ceil(cfg.epochs * n / cfg.batch_size)))
