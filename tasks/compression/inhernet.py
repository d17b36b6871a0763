"""InherNet: a smaller network inherited from the teacher by asymmetric low-rank decomposition.

Follows Zhou, Shi, Xu, Jiang & Chen, "Beyond Student: An Asymmetric Network for Neural Network
Inheritance" (ICLR 2026; demo code zyy-2001/InherNet-Demo): every chosen linear ``W = U Σ Vᵀ``
becomes an :class:`InherLinear` of rank ``r``, one shared down factor ``A = V_rᵀ`` and ``H`` up
factors ``B_h = U_r Σ_r`` mixed by a softmax gate on the rank-``r`` code (``H > 1``), ranks spread
over the matrices by a parameter budget (``uniform`` or ``spectrum`` allocation).

Deviation: the demo divides each head's ``U_r Σ_r`` by ``H``, which scales the layer's output by
``1/H`` under a softmax gate; here every head starts from the whole ``U_r Σ_r``, so the inherited
network computes the rank-``r`` truncation of the teacher whatever the gate. The result saves and
loads with :func:`save_inhernet` / :func:`load_inhernet` (not ``from_pretrained``); :func:`to_dense`
multiplies single-head factors back. Details: docs/pruning.md.

>>> inh = inhernet(teacher, InherNetConfig(target_fraction=0.5))          # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require, to_dict
from tasks.common.io import atomic_dir
from tasks.common.registry import MethodSpec
from tasks.compression.block_pruning import decoder_layers, n_params
from tasks.compression.registry import register_pruner
from tasks.zoo.compressed import unique_state

ALLOCATIONS = ("uniform", "spectrum")
SIGMA_SPLITS = ("up", "sqrt")
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class InherNetConfig(MethodSpec):
    """InherNet. The size: at most one of ``target_fraction`` (of the teacher's parameters, in (0, 1]),
    ``target_params`` (an absolute count) or ``rank`` (one rank for every matrix, capped at its
    full rank); none set = ``target_fraction`` 0.5. ``allocation``: ``uniform`` or ``spectrum``
    (ranks under a budget); ``min_rank``: the smallest rank a matrix gets. ``heads``: up factors per
    linear (``H``; 1 = a plain low-rank pair, no gate). ``sigma``: ``up`` or ``sqrt`` (where ``Σ_r``
    goes). ``modules``: names of the decoder layers' linears to factor (``q_proj``, ...; empty =
    all). ``seed``: the gates' initialisation."""

    method: Literal["inhernet"] = "inhernet"
    target_fraction: float | None = None
    target_params: int | None = None
    rank: int | None = None
    allocation: Literal["uniform", "spectrum"] = "uniform"
    min_rank: int = 1
    heads: int = 1
    sigma: Literal["up", "sqrt"] = "up"
    modules: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [k for k in ("target_fraction", "target_params", "rank") if getattr(self, k) is not None]
        require(len(given) <= 1, given[-1] if given else "target_fraction",
                f"set at most one of target_fraction, target_params, rank; got {given}")
        require(self.target_fraction is None or 0 < self.target_fraction <= 1, "target_fraction",
                f"must be in (0, 1], got {self.target_fraction}")
        require(self.target_params is None or self.target_params >= 1, "target_params",
                f"must be >= 1, got {self.target_params}")
        require(self.rank is None or self.rank >= 1, "rank", f"must be >= 1, got {self.rank}")
        require(self.allocation in ALLOCATIONS, "allocation",
                f"must be one of {list(ALLOCATIONS)}, got {self.allocation!r}")
        at_least(self.min_rank, 1, "min_rank")
        at_least(self.heads, 1, "heads")
        require(self.sigma in SIGMA_SPLITS, "sigma", f"must be one of {list(SIGMA_SPLITS)}, got {self.sigma!r}")
        require(all(isinstance(m, str) and m for m in self.modules), "modules",
                f"must be non-empty linear names, got {list(self.modules)}")

    @property
    def fraction(self) -> float | None:
        """The budget as a fraction of the teacher, when it is one (the default 0.5 when nothing is set)."""
        if self.target_fraction is not None:
            return self.target_fraction
        return 0.5 if self.target_params is None and self.rank is None else None


# ---------------------------------------------------------------------------------------------
# The factored linear


class InherLinear(nn.Module):
    """``y = Σ_h softmax(G z + c)_h · B_h z + b``, ``z = A x``: InherNet's asymmetric low-rank linear.

    Shapes: ``down.weight`` A (r, n), ``up`` B (H, m, r), ``bias`` (m,) or None, ``gate`` (H, r)
    + (H,) when ``H > 1``. Input (..., n), output (..., m). With ``H = 1`` it is ``B A x + b``.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, heads: int = 1, bias: bool = False,
                 *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.rank, self.heads = in_features, out_features, rank, heads
        self.down = nn.Linear(in_features, rank, bias=False, **kw)
        self.up = nn.Parameter(torch.zeros(heads, out_features, rank, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        self.gate = nn.Linear(rank, heads, **kw) if heads > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.down(x)
        if self.gate is None:
            return F.linear(z, self.up[0], self.bias)
        weights = torch.softmax(self.gate(z), dim=-1)                    # (..., H)
        per_head = torch.einsum("...r,hor->...ho", z, self.up)           # (..., H, m)
        y = (weights.unsqueeze(-1) * per_head).sum(-2)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """``B A`` (m, n) for a single-head layer; ``ValueError`` when ``H > 1`` (the mix depends on the input)."""
        if self.gate is not None:
            raise ValueError(f"heads: a {self.heads}-head InherLinear mixes its heads per token; it has no dense weight")
        return self.up[0] @ self.down.weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"heads={self.heads}, bias={self.bias is not None}")


def factor_cost(in_features: int, out_features: int, rank: int, heads: int, bias: bool) -> int:
    """Parameters of an :class:`InherLinear`: ``r n + H m r (+ H r + H for the gate) (+ m)``."""
    gate = heads * rank + heads if heads > 1 else 0
    return rank * in_features + heads * out_features * rank + gate + (out_features if bias else 0)


def factorable_linears(model: nn.Module, modules: tuple[str, ...] = ()) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules inside the decoder layers, by full module name, whose last name part
    is in ``modules`` (all when empty). Raises ``ValueError`` naming ``modules`` when none match."""
    decoder_layers(model)
    inner = getattr(model, "model", model)
    prefix = "model.layers." if inner is not model else "layers."
    out = {}
    for name, mod in model.named_modules():
        if name.startswith(prefix) and isinstance(mod, nn.Linear) and (not modules or name.rsplit(".", 1)[-1] in modules):
            out[name] = mod
    if not out:
        raise ValueError(f"modules: no decoder-layer nn.Linear is named any of {list(modules)}")
    return out


# ---------------------------------------------------------------------------------------------
# Rank allocation


@dataclass
class _Matrix:
    name: str
    m: int
    n: int
    bias: bool
    s: torch.Tensor  # singular values, descending, float64

    @property
    def full(self) -> int:
        return min(self.m, self.n)

    def dense(self) -> int:
        return self.m * self.n + (self.m if self.bias else 0)


def _uniform_ranks(mats: list[_Matrix], ratio: float, min_rank: int) -> dict[str, int]:
    return {x.name: min(x.full, max(min_rank, math.floor(ratio * x.full + 1e-9))) for x in mats}


def allocate_ranks(mats: list[_Matrix], fixed: int, budget: int, cfg: InherNetConfig) -> tuple[dict[str, int], float | None]:
    """Ranks ``{name: r}`` whose student (``fixed`` + factored linears) has at most ``budget``
    parameters, and the uniform ratio ``ρ`` found (None for ``spectrum``). Raises ``ValueError``
    naming the budget's key when even ``min_rank`` everywhere does not fit."""

    def total(ranks: dict[str, int]) -> int:
        return fixed + sum(factor_cost(x.n, x.m, ranks[x.name], cfg.heads, x.bias) for x in mats)

    floor = {x.name: min(x.full, cfg.min_rank) for x in mats}
    if total(floor) > budget:
        key = "target_params" if cfg.target_params is not None else "target_fraction"
        raise ValueError(f"{key}: a budget of {budget} parameters is below the smallest student "
                         f"({total(floor)}: {fixed} outside the factored linears, min_rank {cfg.min_rank})")
    if cfg.allocation == "uniform":
        if total(_uniform_ranks(mats, 1.0, cfg.min_rank)) <= budget:
            return _uniform_ranks(mats, 1.0, cfg.min_rank), 1.0
        # total(ρ) is a non-decreasing step function of ρ: bisect for the largest ρ that fits.
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(_uniform_ranks(mats, mid, cfg.min_rank)) <= budget else (lo, mid)
        return _uniform_ranks(mats, lo, cfg.min_rank), lo
    # spectrum: one global order of rank units beyond min_rank, by retained energy per parameter.
    units = []
    for i, x in enumerate(mats):
        cost = factor_cost(x.n, x.m, 1, cfg.heads, False) - (cfg.heads if cfg.heads > 1 else 0)  # one more rank
        energy = x.s.pow(2)
        share = energy / energy.sum().clamp_min(1e-300)
        for j in range(floor[x.name], x.full):
            units.append((-float(share[j]) / cost, i, j, cost))
    units.sort()
    ranks = dict(floor)
    room = budget - total(floor)
    for _, i, j, cost in units:
        if cost > room:
            break  # a prefix of one fixed order: a larger budget only adds units
        ranks[mats[i].name] += 1
        room -= cost
    return ranks, None


# ---------------------------------------------------------------------------------------------
# Building the inherited network


@dataclass
class InheritedModel:
    """What :func:`inhernet` returns: the inherited model (eval mode), each factored linear's rank,
    the retained energy ``Σ_{j<r} σ_j² / Σ_j σ_j²`` of each, the parameter counts and the budget."""

    model: nn.Module
    ranks: dict[str, int]
    energy: dict[str, float]
    heads: int
    params_before: int
    params_after: int
    budget: int | None
    rank_ratio: float | None
    config: dict[str, Any] = field(default_factory=dict)
    method: str = "inhernet"

    @property
    def params_removed(self) -> int:
        return self.params_before - self.params_after

    def meta(self) -> dict[str, Any]:
        """JSON-friendly record: method, resolved config, ranks, retained energy, parameter counts."""
        return {"method": self.method, "config": self.config, "heads": self.heads, "ranks": self.ranks,
                "energy": {k: round(v, 6) for k, v in self.energy.items()},
                "mean_energy": round(float(np.mean(list(self.energy.values()))), 6) if self.energy else None,
                "params_before": self.params_before, "params_after": self.params_after,
                "params_removed": self.params_removed, "budget": self.budget, "rank_ratio": self.rank_ratio}


def thin_svd(w: torch.Tensor, max_condition: float = 1e6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, S, Vh)`` of ``w`` (m, n) in float64, singular values descending, as
    ``torch.linalg.svd(w, full_matrices=False)`` gives them, about twice as fast on CPU.

    The eigendecomposition of the smaller Gram matrix (``w wᵀ`` or ``wᵀ w``) gives ``U`` and ``Σ²``,
    and ``Vh = Σ⁻¹ Uᵀ w``. Squaring the matrix squares its condition number, so directions with
    ``σ_j < σ_max / max_condition`` would come out inaccurate: a matrix that has any falls back to
    the direct SVD (float64's 1e-16 on ``σ²`` leaves ``σ_j`` a relative error below 1e-4 at 1e6).
    """
    w = w.detach().double()
    if w.shape[0] > w.shape[1]:
        u, s, vh = thin_svd(w.T, max_condition)
        return vh.T, s, u.T
    evals, evecs = torch.linalg.eigh(w @ w.T)
    s = evals.flip(0).clamp_min(0.0).sqrt()
    if s.numel() == 0 or s[-1] * max_condition < s[0] or not bool(torch.isfinite(s).all()):
        return torch.linalg.svd(w, full_matrices=False)
    u = evecs.flip(1)
    return u, s, (u.T @ w) / s[:, None]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def inherit_linear(linear: nn.Linear, rank: int, heads: int, sigma: str = "up", *,
                   svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   generator: torch.Generator | None = None) -> InherLinear:
    """An :class:`InherLinear` of ``rank`` initialised from ``linear``'s principal components.

    ``svd``: ``(U, S, Vh)`` of ``linear.weight`` (float64) when already computed. The gate (``heads``
    > 1) gets small random weights from ``generator``; every head starts at ``U_r Σ_r`` (or
    ``U_r √Σ_r`` with ``sigma="sqrt"``), so the output equals ``W_r x + b`` for any gate.
    """
    w = linear.weight.detach()
    u, s, vh = svd if svd is not None else thin_svd(w)
    r = min(rank, s.numel())
    if sigma == "up":
        b, a = u[:, :r] * s[:r], vh[:r]
    else:
        root = s[:r].sqrt()
        b, a = u[:, :r] * root, root[:, None] * vh[:r]
    out = InherLinear(linear.in_features, linear.out_features, r, heads, linear.bias is not None,
                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.down.weight.copy_(a.to(w.dtype))
        out.up.copy_(b.to(w.dtype).unsqueeze(0).expand(heads, -1, -1))
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        if out.gate is not None:
            bound = 1.0 / math.sqrt(r)  # nn.Linear's default range, drawn from a seeded generator
            out.gate.weight.copy_(torch.empty(out.gate.weight.shape, dtype=torch.float64).uniform_(-bound, bound, generator=generator))
            out.gate.bias.copy_(torch.empty(heads, dtype=torch.float64).uniform_(-bound, bound, generator=generator))
    return out


@register_pruner("inhernet", InherNetConfig)
def inhernet(teacher: nn.Module, cfg: InherNetConfig, *, calib_tokens: np.ndarray | torch.Tensor | None = None) -> InheritedModel:
    """InherNet: a copy of ``teacher`` whose decoder linears are SVD-initialised :class:`InherLinear`
    with ranks fitted to the budget. ``teacher`` is left unchanged.

    ``calib_tokens`` is accepted for the common method signature and not used: the paper's
    inheritance is data-free (plain SVD of the weights). Raises ``ValueError`` naming the budget's
    key when the budget is below the smallest possible student.
    """
    del calib_tokens
    linears = factorable_linears(teacher, cfg.modules)
    before = n_params(teacher)
    mats, svds = [], {}
    for name, lin in linears.items():
        u, s, vh = thin_svd(lin.weight)
        svds[name] = (u, s, vh)
        mats.append(_Matrix(name, lin.out_features, lin.in_features, lin.bias is not None, s))
    fixed = before - sum(x.dense() for x in mats)
    if cfg.rank is not None:
        ranks = {x.name: min(x.full, max(cfg.rank, cfg.min_rank)) for x in mats}
        budget, ratio = None, None
    else:
        budget = cfg.target_params if cfg.target_params is not None else int(math.floor(cfg.fraction * before))
        ranks, ratio = allocate_ranks(mats, fixed, budget, cfg)

    student = copy.deepcopy(teacher)
    gen = torch.Generator().manual_seed(cfg.seed)
    energy = {}
    for x in mats:
        _set_module(student, x.name, inherit_linear(linears[x.name], ranks[x.name], cfg.heads, cfg.sigma,
                                                    svd=svds[x.name], generator=gen))
        e = x.s.pow(2)
        energy[x.name] = float(e[: ranks[x.name]].sum() / e.sum().clamp_min(1e-300))
    after = n_params(student)
    expected = fixed + sum(factor_cost(x.n, x.m, ranks[x.name], cfg.heads, x.bias) for x in mats)
    assert after == expected, (after, expected)
    return InheritedModel(student.eval(), ranks, energy, cfg.heads, before, after, budget, ratio, to_dict(cfg))


# ---------------------------------------------------------------------------------------------
# On disk, and back to a plain model


def inher_linears(model: nn.Module) -> dict[str, InherLinear]:
    """The :class:`InherLinear` modules of a model, by full module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, InherLinear)}


def save_inhernet(model: nn.Module, folder: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write an inherited model to ``folder``: ``config.json`` (its transformers config),
    ``inhernet.json`` (format version, every factored linear's in/out features, rank, heads and
    bias, tied tensor names, and ``meta`` — e.g. :meth:`InheritedModel.meta`) and
    ``model.safetensors`` (the state dict, tied tensors stored once). Read back by :func:`load_inhernet`."""
    from safetensors.torch import save_file

    layout = {n: {"in_features": m.in_features, "out_features": m.out_features, "rank": m.rank,
                  "heads": m.heads, "bias": m.bias is not None} for n, m in inher_linears(model).items()}
    if not layout:
        raise ValueError(f"model: {type(model).__name__} has no InherLinear modules (not made by inhernet)")
    tensors, tied = unique_state(model)
    out = Path(folder)
    with atomic_dir(out) as tmp:
        model.config.save_pretrained(str(tmp))
        (Path(tmp) / "inhernet.json").write_text(json.dumps(
            {"format": FORMAT_VERSION, "class": type(model).__name__, "linears": layout, "tied": tied,
             "meta": to_dict(meta or {})}, indent=1, sort_keys=True, allow_nan=False))
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(Path(tmp) / "model.safetensors"))
    return out


def load_inhernet(folder: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The inherited model written by :func:`save_inhernet` (eval mode): the architecture is built
    from ``config.json``, its linears replaced per ``inhernet.json``, the weights loaded strictly.
    Raises ``ValueError`` naming the file when ``inhernet.json`` is missing or of another format."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    spec_path = folder / "inhernet.json"
    if not spec_path.exists():
        raise ValueError(f"{spec_path}: missing (not a folder written by save_inhernet)")
    spec = json.loads(spec_path.read_text())
    if spec.get("format") != FORMAT_VERSION:
        raise ValueError(f"{spec_path}: format {spec.get('format')!r}, this code reads {FORMAT_VERSION}")
    config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_config(config)
    dtype = next(model.parameters()).dtype
    for name, s in spec["linears"].items():
        _set_module(model, name, InherLinear(s["in_features"], s["out_features"], s["rank"], s["heads"], s["bias"],
                                             dtype=dtype))
    state = load_file(str(folder / "model.safetensors"))
    for alias, stored in spec.get("tied", {}).items():
        state[alias] = state[stored]
    model.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.to(device).eval()


def to_dense(model: nn.Module) -> nn.Module:
    """A copy of an inherited model with every single-head :class:`InherLinear` multiplied back into
    an ``nn.Linear`` (``W = B A``): a plain model of the teacher's class that saves and loads with
    ``save_pretrained``/``from_pretrained``, computing the same function. Raises ``ValueError``
    naming ``heads`` for a multi-head layer."""
    dense = copy.deepcopy(model)
    for name, m in inher_linears(dense).items():
        w = m.dense_weight().detach()
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        _set_module(dense, name, lin)
    return dense.eval()
