"""Needle-in-a-haystack retrieval: does a model still find one fact in a long context under sparsity?

The needle-in-a-haystack test (Kamradt 2023, github.com/gkamradt/LLMTest_NeedleInAHaystack): a
haystack of held-out text exactly ``context_tokens`` long with one needle, ``"The secret code of
<name> is <5-digit number>."``, at a relative ``depth``, and a question the model completes.

Deviation: scoring ranks the true number against ``n_distractors`` other numbers by log-likelihood
instead of parsing greedy generation (one prefill and one batched pass per item, no free-text
parsing), which asks less than exact generation, so accuracies read higher than generation-based
NIAH scores at equal recall. The prompt is prefilled under the sparse handle; the candidates are
scored from its KV cache under the handle for activation sparsity (TEAL, WINA) and with exact
attention for sparse-prefill methods (QuoKA, ProxyAttn), whose papers decode densely. Details and an
example: docs/sparse.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

from tasks.common.config import at_least, in_interval, require
from tasks.sparse.attention import AttentionSparsity

NAMES = ("Maria", "James", "Aiko", "Omar", "Lena", "Pavel", "Chloe", "Ravi", "Ingrid", "Tomas", "Zara", "Kofi",
         "Elena", "Hugo", "Mei", "Diego", "Nadia", "Felix", "Amara", "Jonas", "Priya", "Mateo", "Yara", "Sven",
         "Leila", "Bruno", "Hana", "Idris", "Clara", "Tariq", "Olga", "Niko")
NEEDLE = "The secret code of {name} is {code}."
QUESTION = "\n\nWhat is the secret code of {name}? The secret code of {name} is"
ANSWER = " {code}."


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """``lengths``: prompt lengths in tokens, needle and question included. ``depths``: where the
    needle starts, as a fraction of the haystack before the question (0 = its first token).
    ``items_per_depth``: items per (length, depth), each with its own filler span, name and code.
    ``n_distractors``: other 5-digit numbers ranked against the true one. ``snap_tokens``: how far
    the needle may move to start right after a sentence end. ``seed``: the set is a function of it."""

    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    items_per_depth: int = 1
    n_distractors: int = 9
    snap_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        require(len(self.lengths) > 0 and all(n >= 64 for n in self.lengths), "lengths",
                f"needs at least one length, each >= 64 tokens, got {list(self.lengths)}")
        require(len(self.depths) > 0 and all(0.0 <= d <= 1.0 for d in self.depths), "depths",
                f"needs at least one depth, each in [0, 1], got {list(self.depths)}")
        at_least(self.items_per_depth, 1, "items_per_depth")
        in_interval(self.n_distractors, 1, 1000, "n_distractors", "[]")
        at_least(self.snap_tokens, 0, "snap_tokens")


@dataclass(frozen=True)
class NeedleItem:
    """One haystack. ``prompt``: token ids, ``context_tokens`` long; the needle's tokens are
    ``prompt[needle_start : needle_start + needle_len]``. ``candidates``: token ids of each
    continuation (``" <code>."``); ``answer``: the index of the true one."""

    prompt: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]
    answer: int
    name: str
    code: str
    context_tokens: int
    depth: float
    needle_start: int
    needle_len: int


def _sentence_end_after(tok: Any, filler: Sequence[int], target: int, window: int) -> int:
    """The insertion point in ``[target - window, target + window]`` nearest ``target`` that
    follows a token ending a sentence (``.``, ``!``, ``?`` or a newline); ``target`` if none."""
    lo, hi = max(1, target - window), min(len(filler), target + window)
    if hi < lo:
        return target
    pieces = tok.decode_batch([[t] for t in filler[lo - 1 : hi]])
    ends = [lo + i for i, p in enumerate(pieces) if p.rstrip(" ").endswith((".", "!", "?", "\n"))]
    return min(ends, key=lambda p: (abs(p - target), p)) if ends else target


def build_retrieval_set(tok: Any, texts: Sequence[str], cfg: RetrievalConfig) -> list[NeedleItem]:
    """Items for every (length, depth) of ``cfg``, ``items_per_depth`` each, a function of ``cfg.seed``.

    ``tok``: a tokenizer with ``encode(text, add_special_tokens=False)`` and ``decode_batch``
    (:class:`tasks.lm.tokenizer.TokenizerAdapter`). ``texts``: held-out documents, joined
    with blank lines into one filler stream from which each item takes a random span. Raises
    ``ValueError`` when the texts are shorter than the longest haystack."""
    rng = np.random.default_rng(cfg.seed)
    stream = tok.encode("\n\n".join(texts), add_special_tokens=False)
    items = []
    for n in cfg.lengths:
        for depth in cfg.depths:
            for _ in range(cfg.items_per_depth):
                name = str(NAMES[rng.integers(len(NAMES))])
                codes = rng.choice(90000, size=cfg.n_distractors + 1, replace=False) + 10000
                code = str(codes[0])
                needle = tok.encode(" " + NEEDLE.format(name=name, code=code), add_special_tokens=False)
                question = tok.encode(QUESTION.format(name=name), add_special_tokens=False)
                hay = n - len(needle) - len(question)
                require(hay >= 1, "lengths", f"{n} tokens leave no room for filler around the needle and question")
                if len(stream) < hay:
                    raise ValueError(f"held-out texts give {len(stream)} tokens, fewer than the {hay}-token haystack "
                                     f"of a {n}-token item: pass more texts")
                start = int(rng.integers(len(stream) - hay + 1))
                filler = stream[start : start + hay]
                at = _sentence_end_after(tok, filler, round(depth * hay), cfg.snap_tokens)
                prompt = tuple(filler[:at] + needle + filler[at:] + question)
                order = rng.permutation(len(codes))
                candidates = tuple(tuple(tok.encode(ANSWER.format(code=c), add_special_tokens=False))
                                   for c in codes[order])
                items.append(NeedleItem(prompt=prompt, candidates=candidates, answer=int(np.argmin(order)),
                                        name=name, code=code, context_tokens=n, depth=depth, needle_start=at,
                                        needle_len=len(needle)))
    return items


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def candidate_logliks(model: nn.Module, item: NeedleItem, handle: Any | None = None,
                      sparse_answer: bool | None = None) -> np.ndarray:
    """``log p(candidate | prompt)`` for each candidate of ``item``, (n_candidates,) float64.

    The prompt runs once (under ``handle`` if given, keeping its KV cache); the candidates run as
    one right-padded batch over that cache — padding comes after each candidate's tokens, so the
    causal mask keeps it out of their scores. ``sparse_answer``: whether ``handle`` stays on for the
    candidates (None: off for sparse-prefill attention methods, on for activation sparsity)."""
    if sparse_answer is None:
        sparse_answer = not isinstance(handle, AttentionSparsity)
    context = getattr(model.config, "max_position_embeddings", None)
    longest = len(item.prompt) + max(len(c) for c in item.candidates)
    if context is not None and longest > context:
        raise ValueError(f"a {item.context_tokens}-token item with its answer ({longest} tokens) is longer than the "
                         f"model's {context}-token context")
    device = _model_device(model)
    prompt = torch.tensor([item.prompt], device=device)
    with handle if handle is not None else contextlib.nullcontext():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    first = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    scores = np.array([float(first[c[0]]) for c in item.candidates])
    rest = [c[1:] for c in item.candidates]
    width = max(len(r) for r in rest)
    if width == 0:
        return scores
    k = len(rest)
    # each candidate but its last token, right-padded with that token (its outputs are never read)
    ids = torch.tensor([list(c[:-1]) + [c[-1]] * (width - len(c) + 1) for c in item.candidates], device=device)
    cache = out.cache
    cache.batch_repeat_interleave(k)
    positions = torch.arange(len(item.prompt), len(item.prompt) + width, device=device).expand(k, -1)
    with handle if (handle is not None and sparse_answer) else contextlib.nullcontext():
        logits = model(input_ids=ids, cache=cache, position_ids=positions,
                       use_cache=True).logits.double()
    logp = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(rest):
        if r:
            scores[i] += float(logp[i, torch.arange(len(r)), torch.tensor(r, device=device)].sum())
    return scores


def score_retrieval(model: nn.Module, items: Sequence[NeedleItem], handle: Any | None = None,
                    sparse_answer: bool | None = None) -> pl.DataFrame:
    """One row per item: ``context_tokens``, ``depth``, ``needle_start``, ``correct`` (the true
    number ranks first), ``answer_loglik`` and ``margin`` (true minus the best distractor, nats).

    ``handle``: a sparse handle from :func:`tasks.sparse.registry.sparsify` (not entered; this
    enters it around each prefill), or None for the dense model."""
    rows = []
    for item in items:
        ll = candidate_logliks(model, item, handle, sparse_answer)
        others = np.delete(ll, item.answer)
        rows.append({"context_tokens": item.context_tokens, "depth": item.depth, "needle_start": item.needle_start,
                     "correct": bool(ll[item.answer] > others.max()), "answer_loglik": float(ll[item.answer]),
                     "margin": float(ll[item.answer] - others.max())})
    return pl.DataFrame(rows, schema={"context_tokens": pl.Int64, "depth": pl.Float64, "needle_start": pl.Int64,
                                      "correct": pl.Boolean, "answer_loglik": pl.Float64, "margin": pl.Float64})


def retrieval_accuracy(scores: pl.DataFrame, by: str | Sequence[str] | None = None) -> float | pl.DataFrame:
    """Share of items answered correctly: a float, or per group of ``by`` (columns ``accuracy``, ``items``)."""
    if by is None:
        return float(scores["correct"].mean()) if scores.height else float("nan")
    return scores.group_by(by, maintain_order=True).agg(pl.col("correct").mean().alias("accuracy"),
                                                        pl.len().alias("items"))
