"""Stage 0, prepare: ingest the sources into sharded Parquet and fix the held-out validation split.

Run: ``scalelab run prepare [--preset ci]``. Writes ``data/prepared/{train/shard-*.parquet,
val.parquet, quarantine.parquet, stats.json}`` and ``reports/prepare.json``.
"""

from __future__ import annotations

from prefect import flow

from flows.artifacts import prepare_markdown, publish_markdown
from flows.stage import stage_context, stage_run
from tasks.common.io import atomic_dir, write_json, write_parquet
from tasks.common.lineage import data_ref, log_datasets
from tasks.curation.prepare import PrepareConfig, prepare_corpus, shard_frame


@flow(name="prepare", log_prints=True)
def prepare_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> dict:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(PrepareConfig, "prepare")
    with stage_run(ctx, "prepare", cfg) as run:
        corpus = prepare_corpus(cfg)
        with atomic_dir(ctx.layout.prepared) as out:
            for i, shard in enumerate(shard_frame(corpus.train, cfg.shard_docs)):
                write_parquet(out / "train" / f"shard-{i:05d}.parquet", shard)
            write_parquet(out / "val.parquet", corpus.val)
            write_parquet(out / "quarantine.parquet", corpus.quarantine)
            write_json(out / "stats.json", corpus.stats)
        metrics = {k: v for k, v in corpus.stats.items() if isinstance(v, (int, float))}
        metrics |= {f"quarantined.{k}": v for k, v in corpus.stats.get("quarantined_by_reason", {}).items()}
        write_json(ctx.layout.reports / "prepare.json", metrics)
        run.log_metrics(metrics)
        log_datasets(run, [data_ref(ctx.workdir, ctx.layout.prepared / "train", "prepared-train"),
                           data_ref(ctx.workdir, ctx.layout.prepared / "val.parquet", "val")], "output")
        publish_markdown(run, "prepare", ctx.preset, prepare_markdown(corpus.stats))
        print(f"prepare: {corpus.stats['train_docs']} train / {corpus.stats['val_docs']} val docs, "
              f"{corpus.stats['quarantined']} quarantined")
        return corpus.stats
