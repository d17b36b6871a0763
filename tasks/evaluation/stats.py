"""Statistics over per-item results: Wilson intervals on accuracy, a task's summary, chance accuracy,
and a paired bootstrap comparison of two models on the same items.

``wilson_interval`` is Wilson's score interval (E. B. Wilson 1927, "Probable inference, the law of
succession, and statistical inference", JASA 22(158)); ``paired_difference`` is a percentile bootstrap
over items (Efron & Tibshirani 1993, "An Introduction to the Bootstrap"), resampling the pairs so the
items both models share cancel, with McNemar's discordant count (McNemar 1947) beside it. No deviation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tasks.common.config import at_least, in_interval, require
from tasks.evaluation.requests import EncodedItem
from tasks.evaluation.scoring import ItemResult


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``k / n`` (Wilson 1927):

    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``z`` the two-sided normal
    quantile. Stays inside [0, 1] and is sensible at ``k = 0`` or ``k = n``.

    >>> wilson_interval(0, 10)
    (0.0, 0.2775327998628892)
    """
    from scipy.stats import norm  # lazy: scipy.stats is slow to import and only this interval needs it

    at_least(n, 1, "n")
    require(0 <= k <= n, "k", f"must be in [0, n={n}], got {k}")
    in_interval(confidence, 0, 1, "confidence", "()")
    z = float(norm.ppf(0.5 + confidence / 2))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k = 0 and k = n one end is exactly 0 or 1; rounding must not move it inside
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def task_summary(results: Sequence[ItemResult], *, primary_metric: str = "acc", confidence: float = 0.95) -> dict:
    """``n_items``, ``acc`` and ``len_norm`` with Wilson intervals, mean gold ``bpb``, the primary metric."""
    n = len(results)
    require(n >= 1, "results", "needs at least one item")
    k_acc = sum(r.correct_acc for r in results)
    k_ln = sum(r.correct_len_norm for r in results)
    lo, hi = wilson_interval(k_acc, n, confidence)
    llo, lhi = wilson_interval(k_ln, n, confidence)
    out = {"n_items": n, "acc": k_acc / n, "acc_ci_low": lo, "acc_ci_high": hi, "len_norm": k_ln / n,
           "len_norm_ci_low": llo, "len_norm_ci_high": lhi, "bpb": float(np.mean([r.bpb for r in results])),
           "primary_metric": primary_metric}
    out["primary"] = out[primary_metric]
    return out


def chance_accuracy(encoded: Sequence[EncodedItem]) -> float:
    """Expected accuracy of a uniform guess: mean of 1 / n_choices."""
    return float(np.mean([1.0 / e.item.n_choices for e in encoded]))


def paired_difference(correct_a: Sequence[bool], correct_b: Sequence[bool], *, confidence: float = 0.95,
                      n_bootstrap: int = 2000, seed: int = 0) -> dict:
    """Accuracy of A minus B on the same items, with a paired bootstrap percentile interval over items.

    ``verdict`` is ``"a better"`` / ``"b better"`` only when the interval excludes 0, else
    ``"not distinguishable"`` (a smaller difference than its own noise is not a win).
    ``discordant`` counts the items only one of them got right (McNemar's b + c).
    """
    a = np.asarray(correct_a, dtype=np.float64)
    b = np.asarray(correct_b, dtype=np.float64)
    require(a.shape == b.shape and a.ndim == 1 and a.size >= 1, "correct_b",
            f"needs one outcome per item of A, got shapes {a.shape} and {b.shape}")
    d = a - b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_bootstrap, d.size))
    reps = d[idx].mean(axis=1)
    lo, hi = (float(x) for x in np.quantile(reps, [(1 - confidence) / 2, (1 + confidence) / 2]))
    diff = float(d.mean())
    verdict = "a better" if lo > 0 else "b better" if hi < 0 else "not distinguishable"
    return {"diff": diff, "ci_low": lo, "ci_high": hi, "verdict": verdict, "n_items": int(d.size),
            "discordant": int((d != 0).sum())}
