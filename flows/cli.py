"""``scalelab`` command line: run stages, curate or fit any data, serve schedules, check params.

    scalelab run all --preset ci            # the whole pipeline
    scalelab run train                      # one stage (what dvc.yaml calls)
    scalelab curate --input docs.jsonl --out out/ --recipe dedup_gopher_c4
    scalelab curate --input mail/*.json --text-field body --out out/ --recipe email_dedup_gopher
    scalelab curate --input new/*.jsonl --out out2/ --recipe dedup_gopher_c4 --index idx/ --index-update
    scalelab fit --points points.csv --out fits/
    scalelab validate [--preset demo]       # pre-registered Delta beyond the ladder, then trained and scored
    scalelab eval tasks --model smollm2 --tasks arc_easy,piqa --limit 50 --out eval/
    scalelab microbench --matrix correctness.csv --sizes 10,25,50,100,250 --out mb/
    scalelab select --preset ci             # DDCF fine-tuning data selection -> reports/ddcf.csv
    scalelab prune --model smollm2 --method cosine_drop --set n_remove=2 --out pruned/
    scalelab distill --teacher smollm2 --student pruned/ --loss csd --data-select paser --out recovered/
    scalelab plan --preset ci               # each variant's tokens, ladder, FLOPs and time, before training
    scalelab check-params                   # load every params file under every preset
    scalelab report [--workdir DIR]         # what a finished workdir found (rewrites reports/summary.md)
    scalelab serve                          # scheduled deployments on this machine
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

STAGES = ("prepare", "curate", "train", "compress", "prune", "sparse_eval", "evaluate", "fit", "select")


def _env_defaults(root: Path) -> None:
    """Settings Prefect and friends need on a fresh machine (the user's own values win).

    ``root`` must exist (the CLI creates a new workdir first): Prefect's home goes in it, and
    Prefect neither creates a missing parent nor says why its server then fails to start.
    """
    # lazy: --help and `scalelab report` never load flows.runtime (CLI start-up time)
    from flows.runtime import ensure_workdir

    # Prefect's temporary server keeps its sqlite database here; an unusable home otherwise
    # shows only as a 90-second "Timed out while attempting to connect" later.
    ensure_workdir(os.environ.setdefault("PREFECT_HOME", str(root / ".prefect")), what="PREFECT_HOME")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=".", help="project folder holding params/ (default: .)")
    p.add_argument("--preset", choices=("ci", "demo", "full"), help="default: pipeline.preset in params/pipeline.yaml")


def _text_args(p: argparse.ArgumentParser, calib: int | None) -> None:
    p.add_argument("--text", type=Path, help="Parquet/JSONL with a `text` column (last tenth = validation); "
                   "default: the embedded corpus's prepared splits")
    if calib is not None:
        p.add_argument("--calib-tokens", type=int, default=calib, help="training tokens the method scores on")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--eval-seq-len", type=int, default=256, help="context of the perplexity windows (the same "
                   "in prune and distill, so distill's `before` is prune's `after`)")
    if calib is None:
        p.add_argument("--seq-len", type=int, default=128, help="length of the training windows")
    if calib is not None:
        p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalelab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one stage, or `all` for the whole pipeline")
    run.add_argument("stage", choices=("all", *STAGES))
    _common(run)
    run.add_argument("--workdir", help="where data/, models/, reports/ and mlflow.db go (default: --root)")
    run.add_argument("--runner", choices=("local", "ray"), help="task runner (default: pipeline.runner)")
    run.add_argument("--ray-address", help="join this Ray cluster (e.g. auto, ray://head:10001)")

    plan = sub.add_parser("plan", help="before training: each variant's tokens and the ladder it will get "
                         "(feasibility check), training FLOPs, time on this machine, points that repeat data")
    _common(plan)
    plan.add_argument("--workdir", help="the workdir whose curated data is checked (default: --root)")
    plan.add_argument("--no-timing", dest="timing", action="store_false",
                     help="skip the few timed optimizer steps (no time estimate)")

    cur = sub.add_parser("curate", help="curate any JSONL/Parquet corpus with a named recipe")
    cur.add_argument("--input", nargs="+", type=Path, help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst, .json) or Parquet "
                     "file(s) or globs (default: the sources of prepare.sources in the params)")
    cur.add_argument("--text-field", default="text", help="the key (column) holding each record's text; a dotted "
                     "path reaches into nested records, e.g. payload.body (default: text)")
    cur.add_argument("--id-field", default="id", help="the key holding each record's id, or a dotted path; "
                     "null numbers the records <source>:<file>:<line> (default: id, used when present)")
    cur.add_argument("--token-count", metavar="COUNTER", help="what counts the stats' tokens: words, or "
                     "tokenizer:PATH for a tokenizers JSON file (default: curation.token_count, words)")
    cur.add_argument("--out", required=True, type=Path)
    cur.add_argument("--recipe", required=True, help="a variant name from the recipe file")
    cur.add_argument("--recipe-file", type=Path, help="YAML with a `curation:` section (default: params/curation.yaml)")
    cur.add_argument("--workers", type=int, default=2)
    cur.add_argument("--runner", choices=("local", "ray"), default="local")
    # Override curation.rewrite from the recipe file for recipes with a rewrite step.
    cur.add_argument("--rewrite-kind", choices=("local", "openai"), help="rewrite generator (default: curation.rewrite.kind)")
    cur.add_argument("--base-url", help="OpenAI-compatible server for --rewrite-kind openai")
    cur.add_argument("--model", help="model name the server serves (openai) or a local model folder (local)")
    # Override curation.index from the recipe file: dedup against (and extend) an earlier corpus.
    cur.add_argument("--index", type=Path, metavar="DIR", help="dedup index of earlier corpora: documents "
                     "duplicating it are dropped (duplicate_of = the indexed id) (default: curation.index.path)")
    cur.add_argument("--index-update", action="store_true", default=None, help="add the kept documents to "
                     "--index DIR afterwards (created if missing) (default: curation.index.update)")
    _common(cur)

    fit = sub.add_parser("fit", help="fit L(N, D) to a CSV of N, D, loss[, variant]")
    fit.add_argument("--points", required=True, type=Path)
    fit.add_argument("--out", required=True, type=Path)
    _common(fit)

    val = sub.add_parser("validate", help="pre-registered check: predict Delta at a run beyond the ladder, "
                         "then train it and report hit or miss (after a finished pipeline)")
    val.add_argument("--workdir", help="the finished pipeline's workdir (default: --root)")
    val.add_argument("--runner", choices=("local", "ray"), help="task runner (default: pipeline.runner)")
    val.add_argument("--force", action="store_true", help="predict again, replacing reports/validation/"
                     "predictions.json (by default an existing prediction is what the run is scored against)")
    _common(val)

    ev = sub.add_parser("eval", help="downstream tasks (OLMo's rc suite) on any local causal LM")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    evt = ev_sub.add_parser("tasks", help="score a model on tasks; per-item Parquet and a summary CSV")
    evt.add_argument("--model", required=True, help="a trained model folder, a compressed .safetensors, a "
                     "from_pretrained folder, or `smollm2`")
    evt.add_argument("--base", help="for a compressed .safetensors: the model it was compressed from")
    evt.add_argument("--tasks", required=True, help="comma-separated: arc_easy,hellaswag,piqa,winogrande,...")
    evt.add_argument("--shots", type=int, choices=(0, 5), default=0)
    evt.add_argument("--limit", type=int, help="first N items of each task (default: all)")
    evt.add_argument("--out", required=True, type=Path)
    _common(evt)

    mb = sub.add_parser("microbench", help="evaluation subsets: MDAD, Kendall tau and error of subset "
                        "selectors on a models x items correctness matrix")
    mb.add_argument("--matrix", required=True, type=Path, help="CSV (model name, then one 0/1 column per item) "
                    "or the evaluate stage's reports/downstream/correctness_<task>.parquet")
    mb.add_argument("--sizes", required=True, help="comma-separated subset sizes, e.g. 10,25,50,100,250")
    mb.add_argument("--out", required=True, type=Path)
    mb.add_argument("--root", default=".")

    pr = sub.add_parser("prune", help="prune any local model with one method (entrodrop, cosine_drop, ...): "
                        "a smaller from_pretrained folder and its perplexity before and after")
    pr.add_argument("--model", required=True, help="a trained model folder, a from_pretrained folder, or `smollm2`")
    pr.add_argument("--method", required=True, help="a registered pruning method (entrodrop, cosine_drop, ...)")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="a field of the method's config (repeatable)")
    pr.add_argument("--out", required=True, type=Path)
    _text_args(pr, calib=1024)
    _common(pr)

    di = sub.add_parser("distill", help="recover a pruned model by distillation from its teacher (CSD, KL, DLD) "
                        "on random or PASER-selected windows")
    di.add_argument("--teacher", required=True, help="the unpruned model (folder or `smollm2`)")
    di.add_argument("--student", required=True, help="the pruned model folder (`scalelab prune --out`)")
    di.add_argument("--loss", choices=("csd", "csd_cover", "kl", "dld"), default="csd")
    di.add_argument("--data-select", choices=("random", "paser"), default="paser")
    di.add_argument("--budget", type=float, default=0.25, help="share of the candidate windows trained on")
    di.add_argument("--steps", type=int, default=20)
    di.add_argument("--lr", type=float, default=1e-4)
    di.add_argument("--batch-size", type=int, default=4)
    di.add_argument("--tokens", type=int, default=16384, help="training tokens cut into candidate windows")
    di.add_argument("--train-embeddings", action="store_true")
    di.add_argument("--curve-every", type=int, default=5, help="validation perplexity every N steps as well as "
                    "before the first and after the last (scalelab.json `curve`); 0 = those two only")
    di.add_argument("--out", required=True, type=Path)
    _text_args(di, calib=None)
    _common(di)

    rep = sub.add_parser("report", help="what a finished workdir found: laws, winners, compression, sparsity, "
                         "downstream (rich tables; also rewrites reports/summary.md)")
    rep.add_argument("--workdir", help="the workdir to summarise (default: --root)")
    rep.add_argument("--root", default=".")

    sel = sub.add_parser("select", help="DDCF fine-tuning data selection (the select stage): "
                         "reports/ddcf.csv, accuracy against labels used per method")
    _common(sel)
    sel.add_argument("--workdir", help="where reports/ and mlflow.db go (default: --root)")

    chk = sub.add_parser("check-params", help="load every params file under every preset")
    chk.add_argument("--root", default=".")

    srv = sub.add_parser("serve", help="serve the scheduled deployments (cron) from this process")
    srv.add_argument("--root", default=".")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.root).resolve()
    if args.command == "report":  # reads a workdir; creates nothing, starts no Prefect or MLflow
        return _report(Path(args.workdir or root))
    # lazy: --help and `scalelab report` never load flows.runtime (CLI start-up time)
    from flows.runtime import WorkdirError, ensure_workdir

    if args.command == "select":  # the select stage alone, as `scalelab run select`
        args.command, args.stage, args.runner, args.ray_address = "run", "select", None, None
    if args.command == "run":
        # Every stage's params, not only this stage's: a bad key stops the command before the
        # workdir, the lock, MLflow or Prefect are touched (and before a long stage runs into a
        # later stage's typo).
        problems = _params_problems(root, args.preset)
        for problem in problems:
            print(f"scalelab: error: {problem}", file=sys.stderr)
        if problems:
            return 2

    workdir = root
    if getattr(args, "workdir", None):
        try:
            workdir = args.workdir = ensure_workdir(args.workdir)
        except WorkdirError as exc:
            print(f"scalelab: error: {exc}", file=sys.stderr)
            return 2
        print(f"scalelab: workdir {workdir}")
    try:
        _env_defaults(workdir)
    except WorkdirError as exc:
        print(f"scalelab: error: {exc}", file=sys.stderr)
        return 2
    from tasks.common.config import ConfigError
    from tasks.common.lock import WorkdirBusy

    try:
        if args.command == "run":
            return _run(args, root)
        if args.command == "plan":
            return _plan(args, root)
        if args.command == "curate":
            return _curate(args, root)
        if args.command == "fit":
            return _fit(args, root)
        if args.command == "validate":
            return _validate(args, root)
        if args.command == "eval":
            from flows.evaluate import eval_tasks_command

            return eval_tasks_command(args, root)
        if args.command in ("prune", "distill"):
            from flows.prune import distill_command, prune_command

            return (prune_command if args.command == "prune" else distill_command)(args, root)
        if args.command == "microbench":
            return _microbench(args)
        if args.command == "check-params":
            return _check_params(root)
        if args.command == "serve":
            return _serve(root)
    except (ConfigError, FileNotFoundError, ValueError, WorkdirBusy) as exc:
        if os.environ.get("SCALELAB_DEBUG"):
            raise
        print(f"scalelab: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _params_problems(root: Path, preset: str | None) -> list[str]:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.params_check import check_preset
    from tasks.common.config import ConfigError
    from tasks.common.params import default_preset

    try:
        return check_preset(root, preset or default_preset(root))
    except ConfigError as exc:  # params/pipeline.yaml itself names no valid preset
        return [str(exc)]


def _validate(args: argparse.Namespace, root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.runtime import claim_workdir, make_context
    from flows.validate import validate_flow

    ctx = make_context(root, preset=args.preset, workdir=args.workdir, runner=args.runner)
    with claim_workdir(ctx):
        table = validate_flow(root=str(ctx.root), preset=ctx.preset, workdir=str(ctx.workdir),
                              runner=ctx.pipeline.runner, force=args.force)
    return 0 if table else 1


def _run(args: argparse.Namespace, root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.runtime import claim_workdir, make_context

    ctx = make_context(root, preset=args.preset, workdir=args.workdir, runner=args.runner, ray_address=args.ray_address)
    kwargs = dict(root=str(ctx.root), preset=ctx.preset, workdir=str(ctx.workdir), runner=ctx.pipeline.runner)
    if args.ray_address:
        os.environ["SCALELAB_RAY_ADDRESS"] = args.ray_address
    # The writer lock is taken before Prefect's server starts, so a second writer touches nothing.
    with claim_workdir(ctx):
        if args.stage == "all":
            from flows.pipeline import pipeline_flow

            pipeline_flow(**kwargs)
        else:
            from flows.pipeline import STAGE_FLOWS
            from flows.report_metrics import HEADLINE_STAGES, write_stage_metrics

            STAGE_FLOWS[args.stage](**kwargs, parent_run_id=ctx.parent.run_id if ctx.parent else None)
            if args.stage in HEADLINE_STAGES:  # what dvc.yaml declares as the stage's metrics
                write_stage_metrics(args.stage, ctx.layout.reports)
    if args.stage == "all":
        from flows.report import build_summary, print_summary
        from flows.report_data import load_reports

        print_summary(build_summary(load_reports(ctx.layout.reports)))
    return _failed_units(ctx.layout.reports, None if args.stage == "all" else args.stage)


def _failed_units(reports: Path, stage: str | None) -> int:
    """Name on stderr the units that failed (of ``stage``, or of every stage for ``run all``); 1 for
    ``run all`` when any did, 0 for one stage (``dvc repro`` goes on to the later stages, which run on
    what exists; `scalelab report` and `run all` say it). docs/reliability.md: "One unit fails"."""
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.stage import read_failures

    failures = read_failures(reports)
    if stage is not None:
        failures = failures.filter(failures["stage"] == stage)
    for r in failures.iter_rows(named=True):
        print(f"scalelab: {'warning' if stage else 'error'}: {r['stage']}: {r['unit']} failed: {r['error_type']}: "
              f"{r['error']}", file=sys.stderr)
    if failures.height:
        print(f"scalelab: {failures.height} unit(s) failed; the others finished (reports/failures/, "
              f"tracebacks in reports/failures/<stage>.log)", file=sys.stderr)
    return 1 if failures.height and stage is None else 0


def _plan(args: argparse.Namespace, root: Path) -> int:
    """Print the train stage's plan (flows/plan.py); 2 when the feasibility check would stop it."""
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.plan import print_plan, training_plan
    from flows.runtime import make_context

    plan = training_plan(make_context(root, preset=args.preset, workdir=args.workdir), measure=args.timing)
    print_plan(plan)
    return 2 if plan.feasibility is not None and plan.feasibility.failed else 0


def _report(workdir: Path) -> int:
    """Print the summary of ``workdir`` and rewrite its reports/summary.md; 2 when files are missing
    (what exists is still summarised) or the workdir has no reports, 1 when a unit of a stage failed."""
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.report import print_summary, write_summary

    try:
        summary, _ = write_summary(workdir / "reports")
    except (FileNotFoundError, ValueError) as exc:
        print(f"scalelab: error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    for line in summary.missing:
        print(f"scalelab: error: incomplete workdir: {line}", file=sys.stderr)
    for line in summary.failures:
        print(f"scalelab: error: {line}", file=sys.stderr)
    return 2 if summary.missing else 1 if summary.failures else 0


def _curate(args: argparse.Namespace, root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.curate import curate_any

    rewrite = {"kind": args.rewrite_kind, "base_url": args.base_url}
    if args.model:  # a local model is a folder; a served one is a name
        local = (args.rewrite_kind or "local") == "local"
        rewrite |= {"model_dir": args.model, "gguf_file": None, "model": Path(args.model).name} if local else {"model": args.model}
    stats = curate_any(
        inputs=args.input, out=args.out, recipe=args.recipe, recipe_file=args.recipe_file,
        root=root, preset=args.preset, workers=args.workers, runner=args.runner, rewrite=rewrite,
        index=args.index, index_update=args.index_update, text_field=args.text_field,
        id_field=None if args.id_field == "null" else args.id_field, token_count=args.token_count,
    )
    if not (root / "params").is_dir():
        print(f"params: {stats['params']} (the packaged defaults: no params/ in {root})")
    print(f"kept {stats.get('docs_kept')} of {stats.get('docs_in')} documents "
          f"({stats.get('tokens_kept')} of {stats.get('tokens_in')} tokens by {stats.get('token_count')}) -> {args.out}")
    if "index" in stats:
        ix = stats["index"]
        dup = sum(s.get("duplicates_of_index", 0) for s in stats.get("steps", []))
        print(f"index {ix['path']}: {dup} documents dropped as duplicates of its {ix['docs_before']}"
              + (f"; {ix['docs_added']} added ({ix['docs_after']} indexed)" if "docs_after" in ix else ""))
    if stats.get("run", {}).get("rewrite_pending"):
        print(f"{stats['run']['rewrite_pending']} documents still to rewrite (budget or max_docs_per_run spent): "
              "run the same command again to resume")
    return 0


def _fit(args: argparse.Namespace, root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from tasks.common.params import default_preset, load_stage_config
    from tasks.scaling.config import FitConfig
    from tasks.scaling.report import fit_points, read_points, write_fit_report

    preset = args.preset or default_preset(root)
    cfg = load_stage_config(FitConfig, root, "fit", preset)
    points = read_points(args.points)
    report = fit_points(points, cfg)
    rows = joint_decisions(points, cfg, report)
    paths = write_fit_report(report, points, args.out)
    if rows is not None:
        from flows.fit import DECISION_COLUMNS
        from tasks.common.io import write_csv
        from tasks.scaling.report import write_decision_plots

        paths.append(write_csv(args.out / "decisions.csv", pl_frame(rows, DECISION_COLUMNS)))
        paths += write_decision_plots(rows, args.out)
    for path in paths:
        print(path)
    return 0


def pl_frame(rows: list[dict], columns: tuple[str, ...]):
    import polars as pl

    if not rows:
        return pl.DataFrame(schema=dict.fromkeys(columns, pl.String))
    return pl.DataFrame([{c: r.get(c) for c in columns} for r in rows], infer_schema_length=None)


def joint_decisions(points, cfg, report: dict) -> list[dict] | None:
    """With a ``variant`` column of several series: the joint shared-exponent fit, the nested test
    and projected Delta against ``fit.decisions.reference`` (else the first series by name) into
    ``report["decisions"]``; returns the decision rows (None for a single series)."""
    import dataclasses

    import polars as pl

    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from tasks.scaling.compute_optimal import fit_flops_per_token
    from tasks.scaling.decisions import decision_report

    if "variant" not in points.columns or points["variant"].n_unique() < 2:
        return None
    if "C" not in points.columns:
        points = points.with_columns((6.0 * pl.col("N") * pl.col("D")).alias("C"))
    names = sorted(points["variant"].cast(pl.String).unique().to_list())
    reference = cfg.decisions.reference if cfg.decisions.reference in names else names[0]
    dcfg = dataclasses.replace(cfg.decisions, reference=reference,
                               compared=tuple(v for v in cfg.decisions.compared if v in names and v != reference))
    ref = points.filter(pl.col("variant") == reference)
    flops = fit_flops_per_token(ref["N"].to_numpy(), ref["D"].to_numpy(), ref["C"].to_numpy())
    out = decision_report(points.with_columns(pl.col("variant").cast(pl.String)), None, dcfg, flops=flops)
    rows = out.pop("rows")
    report["decisions"] = out
    return rows


def _microbench(args: argparse.Namespace) -> int:
    """Every selector at every size; writes microbench.csv (method, n, mdad, kendall_tau, mae, ...),
    microbench_bins.csv (ranking probability per gap bin), microbench.json (config and input) and
    microbench.png (MDAD against n). Everything is checked before anything is written."""
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from tasks.common.config import to_dict
    from tasks.common.io import write_csv, write_json
    from tasks.evaluation.microbench import MicrobenchConfig, compare_selectors, plot_mdad, read_correctness_matrix

    sizes = []
    for part in (p.strip() for p in args.sizes.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--sizes: {part!r} is not a positive integer (e.g. --sizes 10,25,50)")
        sizes.append(int(part))
    matrix = read_correctness_matrix(args.matrix)
    too_big = [n for n in sizes if n > len(matrix.items)]
    if too_big:
        raise ValueError(f"--sizes: {too_big[0]} is larger than the {len(matrix.items)} items of {args.matrix}")
    cfg = MicrobenchConfig()
    result = compare_selectors(matrix, sizes, cfg)
    out = Path(args.out)
    write_csv(out / "microbench.csv", result.table)
    write_csv(out / "microbench_bins.csv", result.bins)
    write_json(out / "microbench.json", {"matrix": str(args.matrix), "models": len(matrix.models),
                                         "items": len(matrix.items), "dropped_items": matrix.dropped_items,
                                         "sizes": sizes, "folds": result.folds, "notes": result.notes,
                                         "config": to_dict(cfg)})
    plot_mdad(result.table, out / "microbench.png", probability=cfg.probability,
              title=f"{args.matrix.name}: {len(matrix.models)} models, {len(matrix.items)} items")
    if matrix.dropped_items:
        print(f"note: {matrix.dropped_items} item(s) that some model did not score were left out")
    for note in result.notes:
        print(f"note: {note}")
    for row in result.table.iter_rows(named=True):
        shown = f"{row['mdad'] * 100:.1f} pts" if row["mdad"] is not None else "none"
        tau = f"{row['kendall_tau']:.3f}" if row["kendall_tau"] is not None else "n/a"
        print(f"{row['method']:>16}  n={row['n']:<5} MDAD={shown:<9} tau={tau}  MAE={row['mae'] * 100:.2f} pts")
    print(f"-> {out / 'microbench.csv'}, {out / 'microbench.png'}")
    return 0


def _check_params(root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.params_check import check_all

    problems = check_all(root)
    for p in problems:
        print(p, file=sys.stderr)
    print("params OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 2


def _serve(root: Path) -> int:
    # lazy: a command's modules load only when that command runs (CLI start-up time)
    from flows.deployments import serve_all

    serve_all(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
