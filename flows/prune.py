"""Stage 3b, prune: structured pruning and distillation-based recovery on the ladder and on pretrained models.

Run: ``scalelab run prune [--preset ci]``. For each model (by default the largest trained run of
each variant, and SmolLM2-135M when ``pruning.pretrained`` names it) and each enabled setting of
params/pruning.yaml: prune a copy with the setting's method (EntroDrop, cosine_drop, ...), score it
on the validation split, then recover it by distillation from the unpruned model with every loss of
``pruning.recovery.losses`` (CSD, forward KL, DLD) on the same training windows and score each; the
windows are a ``budget`` share of the candidates chosen at random or by PASER (``data_select``).
Writes ``reports/pruning.csv`` (model, variant, method, removed_fraction, recovery_loss, data_select,
recovery_tokens, ppl, params, flops_per_token, model_path, ...); one MLflow run per (model, row).
Each recovery run's perplexity curve (``recovery.curve_every``) goes to
``reports/pruning_recovery.csv`` (..., step, recovery_tokens, ppl), to its MLflow run as the step
metric ``curve_ppl`` and to ``reports/pruning/recovery.png``. The models ``pruning.save`` names are
kept as ``from_pretrained`` folders in ``models/pruned/<variant>/<run>/<row>/`` for the evaluate stage
and logged as MLflow models by reference (key ``<variant>/<run>/pruned/<row>``; ``mlflow.pyfunc`` loads
the folder), their ppl, params and FLOPs per token linked in the Models tab.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from tokenizers import Tokenizer

from flows.artifacts import publish_table, pruning_table
from flows.compress import PRETRAINED, calib_eval_overlap, check_overlap, prepared_text
from flows.evaluate_models import model_datasets, tokens_path, trained_models, val_tokens_path
from flows.stage import StageUnits, failures_path, mark_ok, stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import atomic_dir, write_json
from tasks.common.lineage import log_datasets, log_model_ref
from tasks.common.parallel import set_process_threads
from tasks.common.params import default_preset, load_stage_config
from tasks.common.tracking import RunRef, tracked_run
from tasks.compression.block_pruning import RemovedBlock
from tasks.compression.distill import recover, token_windows
from tasks.compression.inhernet import inher_linears, save_inhernet
from tasks.compression.pruning import (
    PRUNERS, PruneTables, PruningConfig, RecoveryConfig, SaveConfig, forward_flops_per_token, largest_per_variant,
    n_params, plot_recovery_curves, prune, prune_rows, select_windows,
)
from tasks.curation.prepare import PrepareConfig, prepare_corpus
from tasks.lm.embeddings import question_embeddings
from tasks.lm.loss import evaluate_loss, perplexity
from tasks.training.tokenizer import load_tokens
from tasks.zoo.ladder import load_model
from tasks.zoo.models import ladder_tokenizer, load_causal_lm, token_stream


def pruned_model_key(variant: str, model: str, row: str) -> str:
    """The ``scalelab.model_key`` of a kept pruned model: ``raw/d32/pruned/entrodrop_l1+csd+random``
    (beside the compress stage's ``raw/d32/<setting>``; the evaluate stage links its accuracy by it)."""
    return f"{variant}/{model}/pruned/{row}"


def _logger(parent: RunRef, model_name: str, workdir: str | Path = ".", data: tuple = ()):
    """``log(setting, params, metrics, curve)``: one MLflow child run per row of the table, the
    recovery curve as step metrics (``curve_ppl``, ``curve_recovery_tokens`` at each recovery step),
    the model's ``data`` (``(DataRef, context)`` pairs: its training text, calibration and recovery
    windows included, and the validation text it is scored on) as the run's datasets.

    A row whose model was kept (``params["model_path"]``, relative to ``workdir``) is also logged as
    an MLflow model by reference (:func:`tasks.common.lineage.log_model_ref`: the pyfunc loads the
    folder, no weights are copied) with its ``ppl``, ``params``, ``flops_per_token`` and
    ``removed_fraction`` as metrics of the row's run linked to the model."""

    def log(setting: str, params: dict[str, Any], metrics: dict[str, Any], curve: list[dict[str, Any]]) -> None:
        with tracked_run(f"prune:{model_name}:{setting}", uri=parent.uri, experiment=parent.experiment, parent=parent,
                         params=params | {"stage": "prune", "model": model_name, "setting": setting},
                         tags={"scalelab.stage": "prune"}) as run:
            run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            for ref, context in data:
                log_datasets(run, [ref], context)
            for point in curve:
                run.log_metrics({"curve_ppl": point["ppl"], "curve_recovery_tokens": point["recovery_tokens"]},
                                step=point["step"])
            if params.get("model_path"):
                variant = params.get("variant") or ""
                # the folder's final place: during the stage it is still in the atomic_dir's temporary copy
                folder = (Path(workdir) / params["model_path"]).resolve()
                log_model_ref(run, f"{variant}-{model_name}-pruned-{setting}",
                              {"kind": "pruned", "model_dir": str(folder)},
                              key=pruned_model_key(variant, model_name, setting), model_type="scalelab-pruned",
                              params=params | {"setting": setting},
                              metrics={"ppl": metrics.get("ppl"), "params": params.get("params"),
                                       "flops_per_token": params.get("flops_per_token"),
                                       "removed_fraction": params.get("removed_fraction")})

    return log


def _saver(cfg: SaveConfig, tok: Any, out_dir: str | None, final_dir: str | None, workdir: str, record: dict[str, Any]):
    """``save(name, model)`` for :func:`prune_rows`: the rows ``cfg`` keeps, written to ``out_dir/<name>``
    as ``from_pretrained`` folders with the tokenizer; returns the path the evaluate stage will find
    (under ``final_dir``, relative to ``workdir``), or None. None for every row when ``out_dir`` is."""

    def save(name: str, model: Any) -> str | None:
        if out_dir is None or not cfg.keeps(name):
            return None
        if any(isinstance(m, RemovedBlock) for m in model.modules()) or inher_linears(model):
            # from_pretrained has no field for a removed sub-block or a factored linear: load_causal_lm could not read it
            print(f"prune: {name} not kept for the evaluate stage (a removed attention/MLP sub-block or an "
                  "InherNet model does not load through from_pretrained)")
            return None
        save_model(model, tok, Path(out_dir) / name, record | {"row": name})
        return str((Path(final_dir) / name).relative_to(workdir))

    return save


def split_train(train: np.ndarray, calib_tokens: int, recovery: RecoveryConfig, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(calibration, recovery)`` tokens: the first ``calib_tokens`` and the ``recovery.tokens`` after them."""
    need = calib_tokens + recovery.seq_len
    if len(train) < need:
        raise ValueError(f"{what}: {len(train)} training tokens, need at least {need} "
                         f"(pruning.calib_tokens {calib_tokens} + recovery.seq_len {recovery.seq_len})")
    return train[:calib_tokens], train[calib_tokens : calib_tokens + recovery.tokens]


@task(name="prune-model", cache_policy=NO_CACHE)
def prune_model(model_row: dict, cfg: PruningConfig, parent: RunRef, save_dir: str | None = None,
                final_dir: str | None = None, workdir: str = ".") -> PruneTables:
    """Every enabled setting on one trained model; the rows ``cfg.save`` keeps go to ``save_dir``."""
    set_process_threads(cfg.num_threads)
    model, meta = load_model(model_row["model_dir"])
    seq_len = cfg.seq_len or meta["seq_len"]
    val = load_tokens(model_row["val_path"])
    calib, train = split_train(load_tokens(model_row["train_path"]), cfg.calib_tokens, cfg.recovery, model_row["train_path"])
    check_overlap(calib_eval_overlap(calib, val[: cfg.eval_tokens]), model_row["run"])
    base_row = {"model": model_row["run"], "variant": model_row["variant"], "run": model_row["run"]}
    tokenizer = Tokenizer.from_file(model_row["tokenizer_path"])
    save = _saver(cfg.save, ladder_tokenizer(Path(model_row["tokenizer_path"])), save_dir, final_dir, workdir,
                  {"source": model_row["model_dir"], "variant": model_row["variant"], "run": model_row["run"]})
    return prune_rows(model, settings=cfg.methods(), recovery=cfg.recovery, calib=calib, train=train, val=val,
                      seq_len=seq_len, batch_size=cfg.batch_size, eval_tokens=cfg.eval_tokens, base_row=base_row,
                      log=_logger(parent, model_row["run"], workdir, model_row.get("data", ())),
                      texts=lambda w: tokenizer.decode_batch(w.tolist()), save=save)


def prune_pretrained(name: str, cfg: PruningConfig, prepared: str, parent: RunRef, save_dir: str | None = None,
                     final_dir: str | None = None, workdir: str = ".") -> PruneTables:
    """Every pretrained setting on one pretrained model, on the prepared train/val text in its own tokenizer."""
    set_process_threads(cfg.pretrained_num_threads)
    model, tok, _ = load_causal_lm(name)
    recovery = cfg.pretrained_recovery or cfg.recovery
    prepared_dir = Path(prepared)
    val, train, data = prepared_text(prepared_dir, tok, cfg.pretrained_eval_tokens, cfg.pretrained_calib_tokens + recovery.tokens)
    calib, rec = split_train(train, cfg.pretrained_calib_tokens, recovery, f"{prepared_dir / 'train'} ({name})")
    base_row = {"model": PRETRAINED[name], "variant": "pretrained", "run": None}
    save = _saver(cfg.save, tok, save_dir, final_dir, workdir, {"source": name, "variant": "pretrained"})
    return prune_rows(model, settings=cfg.methods(pretrained=True), recovery=recovery, calib=calib, train=rec,
                      val=val, seq_len=cfg.pretrained_seq_len, batch_size=cfg.pretrained_batch_size,
                      eval_tokens=cfg.pretrained_eval_tokens, base_row=base_row,
                      log=_logger(parent, PRETRAINED[name], workdir, data),
                      texts=lambda w: tok.decode_batch(w.tolist()), save=save)


@flow(name="prune", log_prints=True)
def prune_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(PruningConfig, "pruning")
    with stage_run(ctx, "prune", cfg) as run, atomic_dir(ctx.layout.pruned) as out:
        models = trained_models(ctx, cfg.models, cfg.variants, key="pruning.variants")
        if not cfg.models and cfg.largest_only:
            models = largest_per_variant(models)
        kept = saved_ladder_models(models, cfg.save.ladder)
        data = model_datasets(ctx, models)
        jobs = [dict(model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m)),
                                    "tokenizer_path": str(ctx.layout.tokenizer), "data": data[m["variant"]]},
                     cfg=cfg, parent=run.ref(), workdir=str(ctx.workdir),
                     save_dir=str(out / m["variant"] / m["run"]) if f"{m['variant']}/{m['run']}" in kept else None,
                     final_dir=str(ctx.layout.pruned / m["variant"] / m["run"]))
                for m in models]
        units = StageUnits(ctx, run, "prune")
        names = [f"{m['variant']}/{m['run']}" for m in models]
        tables = units.map(prune_model, jobs, names)
        for name in cfg.pretrained:  # one at a time: its own threads use the cores
            pretrained_dir = Path("pretrained") / PRETRAINED[name]
            names.append(f"pretrained/{PRETRAINED[name]}")
            jobs.append(dict(save_dir=str(out / pretrained_dir) if cfg.save.pretrained else None))
            tables.append(units.call(names[-1], prune_pretrained, name, cfg, str(ctx.layout.prepared), run.ref(),
                                     save_dir=jobs[-1]["save_dir"], final_dir=str(ctx.layout.pruned / pretrained_dir),
                                     workdir=str(ctx.workdir)))
        for job, name in zip(jobs, names):  # what a failed unit half-wrote is not published
            if units.failed(name) and job["save_dir"]:
                shutil.rmtree(job["save_dir"], ignore_errors=True)
        units.close()
        rows = [r for t in tables if t is not None for r in mark_ok(t.rows)]
        rows += [r for m in models for r in units.failed_rows(
            f"{m['variant']}/{m['run']}", [{"model": m["run"], "variant": m["variant"], "run": m["run"], "setting": setting,
                                           "method": method} for setting, (method, _) in cfg.methods().items()])]
        rows += [r for name in cfg.pretrained for r in units.failed_rows(
            f"pretrained/{PRETRAINED[name]}", [{"model": PRETRAINED[name], "variant": "pretrained", "setting": setting,
                                                "method": method}
                                               for setting, (method, _) in cfg.methods(pretrained=True).items()])]
        curves = [c for t in tables if t is not None for c in t.curves]
        write_table(ctx, "pruning", rows, run)
        write_table(ctx, "pruning_recovery", curves, run)
        with atomic_dir(ctx.layout.reports / "pruning") as plots:  # replaced whole: no stale figure
            if curves:
                plot_recovery_curves(curves, plots / "recovery.png")
        run.log_artifact(ctx.layout.reports / "pruning" / "recovery.png", "reports")  # skipped when absent
        n_saved = sum(r.get("model_path") is not None for r in rows)
        run.log_metrics({"models": len(models) + len(cfg.pretrained), "rows": len(rows), "curve_points": len(curves),
                         "models_saved": n_saved})
        publish_table(run, "prune", ctx.preset, pruning_table(rows),
                      "Pruning: perplexity after pruning and after each recovery",
                      "Recovery curves: reports/pruning_recovery.csv and reports/pruning/recovery.png.")
        print(f"prune: {len(rows)} rows -> {ctx.layout.reports / 'pruning.csv'}, {len(curves)} curve points -> "
              f"{ctx.layout.reports / 'pruning_recovery.csv'}, {n_saved} models kept in {ctx.layout.pruned}"
              + (f"; {len(units.failures)} unit(s) FAILED -> {failures_path(ctx.layout.reports, 'prune')}"
                 if units.failures else ""))
        return rows


def saved_ladder_models(models: list[dict], which: str) -> set[str]:
    """``variant/run`` of the pruned ladder models whose rows ``pruning.save`` keeps: ``largest``
    (most parameters; the first in order on a tie), ``all`` or ``none``."""
    if which == "none" or not models:
        return set()
    chosen = models if which == "all" else [max(models, key=lambda m: m["n_params"])]
    return {f"{m['variant']}/{m['run']}" for m in chosen}


# ---------------------------------------------------------------------------------------------
# `scalelab prune` and `scalelab distill`: one method on any local model, outside the pipeline


def parse_options(pairs: list[str] | None, flag: str = "--set") -> dict[str, Any]:
    """``["n_remove=2", "granularity=attention"]`` -> ``{"n_remove": 2, "granularity": "attention"}`` (values read as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {pair!r}: expected key=value")
        out[key.strip()] = yaml.safe_load(value)
    return out


def command_text(tok: Any, root: Path, preset: str | None, text: Path | None, train_tokens: int, val_tokens: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` token streams in ``tok``'s vocabulary: from ``text`` (Parquet or JSONL with a
    ``text`` column; the last tenth of its documents is the validation text), else the embedded
    corpus's prepared train and validation splits (params/prepare.yaml under ``preset``)."""
    import polars as pl

    if text is not None:
        if not text.exists():
            raise FileNotFoundError(f"{text}: no such file")
        frame = pl.read_parquet(text) if text.suffix == ".parquet" else pl.read_ndjson(text)
        if "text" not in frame.columns:
            raise ValueError(f"{text}: no `text` column (columns: {frame.columns})")
        cut = max(1, frame.height * 9 // 10)
        if frame.height < 2:
            raise ValueError(f"{text}: needs at least 2 documents (one for validation), got {frame.height}")
        train_frame, val_frame = frame[:cut], frame[cut:]
    else:
        corpus = prepare_corpus(load_stage_config(PrepareConfig, root, "prepare", preset or default_preset(root)))
        train_frame, val_frame = corpus.train, corpus.val

    return token_stream(tok, train_frame["text"], train_tokens), token_stream(tok, val_frame["text"], val_tokens + 1)


def save_model(model: Any, tok: Any, out: Path, record: dict[str, Any]) -> Path:
    """``model`` as a ``from_pretrained`` folder with its tokenizer and ``scalelab.json`` (``record``);
    ``load_causal_lm(out)`` loads it back."""
    from transformers import PreTrainedTokenizerFast

    inner = getattr(tok, "_tok", tok)
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        if hasattr(inner, "save_pretrained"):
            inner.save_pretrained(str(tmp))
        else:  # the ladder's tokenizers.Tokenizer
            PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=inner.id_to_token(tok.eos_token_id)).save_pretrained(str(tmp))
        write_json(tmp / "scalelab.json", record)
    return out


def _ppl(model: Any, val: np.ndarray, seq_len: int, batch_size: int) -> float:
    return perplexity(evaluate_loss(model, val, seq_len, batch_size))


def prune_command(args: Any, root: Path) -> int:
    """``scalelab prune --model SPEC --method NAME [--set key=value ...] --out DIR``."""
    options = parse_options(args.set)
    (_, cfg), = PRUNERS.parse_settings({args.method: {"method": args.method, **options}}, "--set", prefix="--set").values()
    set_process_threads(args.threads)
    model, tok, meta = load_causal_lm(args.model)
    train, val = command_text(tok, root, args.preset, args.text, args.calib_tokens, args.eval_tokens)
    result = prune(model, cfg, calib_tokens=train)
    before, after = (_ppl(m, val, args.eval_seq_len, args.batch_size) for m in (model, result.model))
    record = {"source": meta.get("source", str(args.model)), "method": args.method, "config": to_dict(cfg),
              "result": result.meta(), "ppl_before": before, "ppl_after": after, "eval_tokens": len(val) - 1,
              "eval_seq_len": args.eval_seq_len, "params_before": n_params(model), "params_after": n_params(result.model),
              "flops_per_token_before": forward_flops_per_token(model, args.eval_seq_len),
              "flops_per_token_after": forward_flops_per_token(result.model, args.eval_seq_len)}
    print(f"{args.method}: params {record['params_before']:,} -> {record['params_after']:,}, "
          f"ppl {before:.2f} -> {after:.2f} on {len(val) - 1} tokens")

    if any(isinstance(m, RemovedBlock) for m in result.model.modules()):
        print("note: attention/MLP sub-blocks were removed; such a model does not load through from_pretrained, "
              f"so only {args.out / 'scalelab.json'} is written (use granularity=layer for a loadable folder)")
        write_json(args.out / "scalelab.json", record)
    elif args.method == "inhernet":
        save_inhernet(result.model, args.out, record)
    else:
        save_model(result.model, tok, args.out, record)
    print(f"-> {args.out}")
    return 0


def distill_command(args: Any, root: Path) -> int:
    """``scalelab distill --teacher SPEC --student DIR --loss csd --data-select paser --out DIR``."""
    rc = RecoveryConfig(losses=(args.loss,), data_select=(args.data_select,), budget=args.budget, steps=args.steps,
                        lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len, tokens=args.tokens,
                        curve_every=args.curve_every)
    set_process_threads(args.threads)
    teacher, tok, _ = load_causal_lm(args.teacher)
    student, stok, smeta = load_causal_lm(args.student)
    if teacher.get_input_embeddings().weight.shape[0] != student.get_input_embeddings().weight.shape[0]:
        raise ValueError(f"--student {args.student}: its vocabulary differs from the teacher's")
    train, val = command_text(tok, root, args.preset, args.text, args.tokens, args.eval_tokens)
    windows = token_windows(train, rc.seq_len)
    k = max(1, round(rc.budget * len(windows)))
    embeddings = None
    if args.data_select == "paser" and k < len(windows):
        embeddings = question_embeddings(tok.decode_batch(windows.tolist()))
    chosen = select_windows(args.data_select, teacher, student, windows, k, rc, embeddings)
    before = _ppl(student, val, args.eval_seq_len, 4)
    if not args.train_embeddings:
        student.get_input_embeddings().weight.requires_grad_(False)
        student.get_output_embeddings().weight.requires_grad_(False)
    curve = recover(student, teacher, windows[chosen], rc.distill(args.loss), every=rc.curve_every, initial=before,
                    evaluate=lambda m: _ppl(m, val, args.eval_seq_len, 4))
    after = curve.evals[-1][2]
    points = [{"step": step, "recovery_tokens": tokens, "ppl": value} for step, tokens, value in curve.evals]
    record = {"teacher": str(args.teacher), "student": smeta.get("source", str(args.student)), "recovery": to_dict(rc),
              "windows": len(chosen), "candidates": len(windows), "tokens": curve.tokens, "losses": curve.losses,
              "ppl_before": before, "ppl_after": after, "curve": points, "eval_tokens": len(val) - 1,
              "eval_seq_len": args.eval_seq_len}
    print(f"{args.loss} on {len(chosen)} of {len(windows)} windows ({args.data_select}), {args.steps} steps: "
          f"ppl {before:.2f} -> {after:.2f}; curve " + ", ".join(f"{p['step']}: {p['ppl']:.2f}" for p in points))
    save_model(student, stok, args.out, record)
    print(f"-> {args.out}")
    return 0
