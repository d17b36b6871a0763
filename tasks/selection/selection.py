"""DDCF's selection proper (Difficulty–Diversity Collaborative Filtering; the DDCF paper; 
public code iNLP-Lab/DDCF) and its baselines.

**Greedy selection** (:func:`greedy_select`): ``S ← S ∪ {argmin_{q ∉ S} λ d_q + (1 − λ)
max_{s ∈ S} cos(e_q, e_s)}``, ``k`` times (λ = 0.2, the paper's default); with ``S`` empty the max
is 0. ``d_q`` is the target's predicted P(correct) (:mod:`tasks.selection.predictor`), ``e_q`` the
question's frozen embedding. Baselines (:func:`select_questions`): ``random``, ``difficulty``
(λ = 1: the ``k`` hardest), ``diversity`` (λ = 0, the first pick the question nearest the pool's
mean embedding) and ``full`` (the whole pool).

Annotation cost (:func:`labels_used`; the paper counts labels, it does not fix this split): ``k``
gold answers for ``random`` and ``diversity``; ``k`` plus the target's ``n_seed`` seed answers for
``ddcf`` and ``difficulty``, which need the target's seed correctness; the pool size for ``full``;
0 for the untouched target (``base``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tasks.selection.config import METHODS


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def greedy_select(difficulty: np.ndarray, embeddings: np.ndarray, k: int, lam: float = 0.2,
                  first: int | None = None) -> np.ndarray:
    """DDCF's greedy selection: ``k`` indices, each ``argmin_q λ·difficulty[q] + (1 − λ)·max_{s∈S}
    cos(e_q, e_s)`` over the not yet selected ``q`` (the max is 0 while ``S`` is empty).

    ``difficulty`` (n,) is the target's predicted P(correct) (low = hard), ``embeddings`` (n, dim).
    ``first`` forces the first pick (used by λ = 0, where every first pick ties). Ties go to the
    lowest index. O(k·n·dim).

    >>> greedy_select(np.array([0.9, 0.1, 0.5]), np.eye(3), 2, lam=1.0).tolist()
    [1, 2]
    """
    difficulty = np.asarray(difficulty, dtype=np.float64)
    embeddings = np.asarray(embeddings, dtype=np.float64)
    n = difficulty.shape[0]
    if difficulty.ndim != 1 or embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings: expected ({n}, dim) for {n} difficulties, got {embeddings.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"k: must be in [1, {n}], got {k}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: must be in [0, 1], got {lam}")
    unit = _unit(embeddings)
    max_sim = np.zeros(n)
    taken = np.zeros(n, dtype=bool)
    chosen: list[int] = []
    for step in range(k):
        if step == 0 and first is not None:
            j = int(first)
        else:
            score = lam * difficulty + (1.0 - lam) * max_sim
            score[taken] = np.inf
            j = int(np.argmin(score))
        chosen.append(j)
        taken[j] = True
        max_sim = np.maximum(max_sim, unit @ unit[j])
    return np.asarray(chosen)


def select_questions(method: str, k: int, *, difficulty: np.ndarray | None, embeddings: np.ndarray,
                     lam: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the pool chosen by ``method`` (see the module docstring)."""
    n = embeddings.shape[0]
    if method == "full":
        return np.arange(n)
    if method == "random":
        return np.sort(rng.choice(n, size=k, replace=False))
    if method == "diversity":
        unit = _unit(embeddings)
        centre = _unit(unit.mean(0, keepdims=True))[0]
        return greedy_select(np.zeros(n), embeddings, k, lam=0.0, first=int(np.argmax(unit @ centre)))
    if difficulty is None:
        raise ValueError(f"method: {method!r} needs the target's predicted difficulty")
    if method == "difficulty":
        return greedy_select(difficulty, embeddings, k, lam=1.0)
    if method == "ddcf":
        return greedy_select(difficulty, embeddings, k, lam=lam)
    raise ValueError(f"method: unknown {method!r}; choose from {', '.join(METHODS)}")


def labels_used(method: str, k: int, *, n_seed: int, n_pool: int) -> int:
    """Annotation cost of a selection (see the module docstring): the pool for ``full``, ``k`` plus
    the target's seed answers for the methods that need its difficulty, else ``k``."""
    return {"ddcf": k + n_seed, "difficulty": k + n_seed, "full": n_pool}.get(method, k)


def selections(methods: Sequence[str], ks: Sequence[int], repeats: int, *, difficulty: np.ndarray,
               embeddings: np.ndarray, lam: float, seed: int, key: int):
    """Yield ``(method, k, pool indices, repeat)`` for every fine-tune: ``full`` once per repeat
    with ``k`` = the pool size; each other method per ``k``, ``random`` redrawn for every repeat
    (seeded by ``(seed, key, k, repeat)``), the deterministic methods selected once and repeated."""
    n = embeddings.shape[0]
    for method in methods:
        if method == "full":
            for rep in range(repeats):
                yield "full", n, np.arange(n), rep
            continue
        for k in ks:
            idx = None
            for rep in range(repeats):
                if idx is None or method == "random":
                    idx = select_questions(method, k, difficulty=difficulty, embeddings=embeddings, lam=lam,
                                           rng=np.random.default_rng([seed, key, k, rep]))
                yield method, k, idx, rep
