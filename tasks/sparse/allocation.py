"""How much each site is sparsified: TEAL's block-wise greedy allocation of a model-wide level.

Liu, Ponnusamy, Cai, Guo, Kim & Athiwaratkun 2024, "Training-Free Activation Sparsity in Large
Language Models" (TEAL, arXiv:2408.14690), Section 4.2 and the authors' ``teal/greedyopt.py``: every transformer
block gets the same target level ``s``; inside a block the sites (the linear layers whose inputs are
sparsified) start dense, and step by step the site whose next increase adds least to the block's
output error is raised, until the block's *effective* sparsity — the sites' levels weighted by their
weight sizes, i.e. the fraction of the block's weight reads skipped — reaches ``s``. Each step
raises a site by ``step / w_i``, with ``w_i`` its weight size over the median of the block's sites
(TEAL's table sets q = 1, k = v = 1/8 .. 1/4, MLP = 2.7 .. 3.5, which is this rule on Llama), so
every step adds about the same effective sparsity; the last step is cut short so that the block
lands on ``s`` (TEAL's loop may overshoot by one step).

The error is measured with the dense model's inputs to the block (captured once), as the mean over
tokens of the L2 norm of the change of the block's output (computed on the innermost module holding
the block's sites, :func:`error_unit`: the MLP alone when only MLP inputs are sparsified), on the last ``last_fraction`` of each
window's positions (TEAL's choice: later positions are closer to decoding). TEAL's code averages
the norm over the sequence axis instead of the hidden axis; we take the per-token norm, which is
what "activation error" means for a token-wise method. Documented choices, each a parameter:
``step`` (TEAL: 0.05), ``last_fraction`` (0.25), ``max_level`` (0.95: no site is silenced entirely).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tasks.sparse.registry import ActivationSparsity, SiteFn

MakeFn = Callable[[str, float], SiteFn]
"""``make_fn(site, level)``: the input transform of ``site`` at sparsity ``level``."""

_BLOCK = re.compile(r"^(.*\.\d+)\.")


def block_of(site: str) -> str:
    """The block a site belongs to: its name up to the last numeric component (``model.layers.3``)."""
    m = _BLOCK.match(site)
    if not m:
        raise ValueError(f"site {site!r} is not inside a numbered block (e.g. model.layers.<i>.mlp.up_proj)")
    return m[1]


def error_unit(sites: list[str]) -> str:
    """The module whose output the greedy search compares: the innermost one holding all of a block's
    sites — the block itself for attention and MLP sites, the MLP alone for TEAL's default MLP sites.
    The MLP is the block's last residual branch, so the change of its output *is* the change of the
    block's output (and costs ~2/3 of the block's compute to recompute). For attention sites alone
    it is the attention's output, an approximation: that change also passes through the MLP."""
    parts = [n.split(".")[:-1] for n in sites]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    unit = ".".join(common)
    return unit if unit.startswith(block_of(sites[0])) else block_of(sites[0])


def effective_sparsity(levels: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Σ level_i · w_i / Σ w_i: the fraction of the sites' weight reads skipped."""
    total = sum(weights[n] for n in levels)
    return sum(levels[n] * weights[n] for n in levels) / total


def _output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_blocks(model: nn.Module, blocks: list[str], input_ids: torch.Tensor
                   ) -> dict[str, tuple[tuple, dict, torch.Tensor]]:
    """One dense forward; for each block, the positional and keyword inputs it got and its output."""
    seen: dict[str, tuple[tuple, dict, torch.Tensor]] = {}

    def hook(name: str):
        def fn(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            seen[name] = (args, dict(kwargs), _output(out).detach().clone())
        return fn

    handles = [model.get_submodule(b).register_forward_hook(hook(b), with_kwargs=True) for b in blocks]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [b for b in blocks if b not in seen]
    if missing:
        raise RuntimeError(f"blocks {missing} were not called by the model's forward")
    return seen


def _block_error(out: torch.Tensor, ref: torch.Tensor, last_fraction: float) -> float:
    start = int(out.shape[-2] * (1 - last_fraction)) if out.dim() >= 2 else 0
    return float((out[..., start:, :] - ref[..., start:, :]).float().norm(dim=-1).mean())


@torch.no_grad()
def greedy_path(
    model: nn.Module,
    sites: Mapping[str, nn.Linear],
    input_ids: torch.Tensor,
    make_fn: MakeFn,
    up_to: float,
    *,
    step: float = 0.05,
    last_fraction: float = 0.25,
    max_level: float = 0.95,
) -> GreedyPath:
    """TEAL's greedy search in every block, run until each block's effective sparsity reaches ``up_to``.

    The search does not depend on the target (each step takes the cheapest increase), so one path
    serves every level up to ``up_to``: :meth:`GreedyPath.levels` reads a level off it. A block whose
    sites all reach ``max_level`` first stops there.
    """
    if not 0.0 <= up_to < 1.0:
        raise ValueError(f"up_to: must be in [0, 1), got {up_to}")
    by_block: dict[str, list[str]] = {}
    for n in sites:
        by_block.setdefault(block_of(n), []).append(n)
    units = {b: error_unit(names) for b, names in by_block.items()}
    io = capture_blocks(model, list(units.values()), input_ids) if up_to > 0 else {}
    path = GreedyPath(weights={}, states={}, errors={})
    for block, names in by_block.items():
        sizes = {n: float(sites[n].weight.numel()) for n in names}
        mid = statistics.median(sizes.values())
        weights = {n: v / mid for n, v in sizes.items()}
        path.weights.update(weights)
        cur = {n: 0.0 for n in names}
        path.states[block], path.errors[block] = [dict(cur)], [0.0]
        if up_to == 0:
            continue
        module = model.get_submodule(units[block])
        args, kwargs, ref = io[units[block]]
        steps = {n: step / weights[n] for n in names}

        def error(trial: dict[str, float]) -> float:
            fns = {n: (sites[n], make_fn(n, lv)) for n, lv in trial.items() if lv > 0}
            with ActivationSparsity(model, fns):
                out = _output(module(*args, **kwargs))
            return _block_error(out, ref, last_fraction)

        while effective_sparsity(cur, weights) < up_to - 1e-12:
            best, best_err = None, float("inf")
            for n in names:  # in model order; ties keep the first
                if cur[n] >= max_level:
                    continue
                err = error(cur | {n: min(max_level, cur[n] + steps[n])})
                if err < best_err:
                    best, best_err = n, err
            if best is None:  # every site at max_level
                break
            cur[best] = min(max_level, cur[best] + steps[best])
            path.states[block].append(dict(cur))
            path.errors[block].append(best_err)
    return path


@dataclass
class GreedyPath:
    """Per block, the sites' levels after each greedy step (``states``, starting all at 0) and the
    block error of each step (``errors``); ``weights``: each site's weight size over its block's median."""

    weights: dict[str, float]
    states: dict[str, list[dict[str, float]]]
    errors: dict[str, list[float]]

    def levels(self, target: float) -> dict[str, float]:
        """Per-site levels at effective sparsity ``target`` in every block: the first state at or
        past it, with its last step cut short so the block lands on ``target`` exactly (TEAL's loop
        may overshoot by one step). A block that stopped below ``target`` gives its last state."""
        out: dict[str, float] = {}
        for states in self.states.values():
            w = {n: self.weights[n] for n in states[0]}
            i = next((i for i, st in enumerate(states) if effective_sparsity(st, w) >= target - 1e-12), len(states) - 1)
            cur = dict(states[i])
            if i > 0 and effective_sparsity(cur, w) > target:
                prev = states[i - 1]
                (n,) = [k for k in cur if cur[k] != prev[k]]
                cur[n] = prev[n] + (target - effective_sparsity(prev, w)) * sum(w.values()) / w[n]
            out.update(cur)
        return out


def greedy_levels(
    model: nn.Module, sites: Mapping[str, nn.Linear], input_ids: torch.Tensor, make_fn: MakeFn, target: float,
    **kwargs: float,
) -> tuple[dict[str, float], GreedyPath]:
    """Per-site levels reaching effective sparsity ``target`` in every block (:func:`greedy_path`)."""
    path = greedy_path(model, sites, input_ids, make_fn, target, **kwargs)
    return path.levels(target), path
