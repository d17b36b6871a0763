"""The pipeline's curate stage: every ci variant through the sharded engine gives what the
in-memory recipe gives on the prepared train split read whole."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlflow
import polars as pl

from flows.curate import VARIANT_STATS, curate_flow, variant_row
from flows.runtime import make_context
from tasks.common.params import load_stage_config
from tasks.common.tracking import WORKDIR_TAG
from tasks.curation.decontam import ValDecontaminator
from tasks.curation.recipes import CurationConfig, FilterCache, run_recipe

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("river market school teacher budget winter village doctor garden window letter station bridge forest "
         "engine harbor island mountain painter opened closed visited crossed reached followed").split()
STOP = "the and of to with that".split()


def prose(rng: random.Random, n_sentences: int = 8) -> str:
    """Sentences of random words and stop words: passes Gopher's rules, no repeated n-grams."""
    def word() -> str:
        return rng.choice(STOP) if rng.random() < 0.3 else rng.choice(WORDS) + "".join(rng.choices("abcdefgh", k=2))
    return " ".join(" ".join(word() for _ in range(rng.randint(8, 14))).capitalize() + "."
                    for _ in range(n_sentences))


def write_prepared(workdir: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A prepared layout (two train shard files, a val split) of 450 documents: exact copies,
    short texts and repetitive texts in different engine shards (ci: 200 documents a shard), and
    train documents that repeat a validation document."""
    rng = random.Random(14)
    texts = [prose(rng) for _ in range(450)]
    for i in range(0, 450, 37):
        texts[i] = f"A short note, number {i}."
    for i in range(20, 450, 61):
        texts[i] = f"Item {i}. " + "The river closed the market and went to the school. " * 8
    for i in (30, 230, 420):
        texts[i] = texts[5]  # exact copies across shards; the lowest id survives
    val_texts = [texts[100], texts[300].upper(), prose(rng)]
    train = pl.DataFrame({"id": [f"d{i:04d}" for i in range(450)], "text": texts, "source": "synthetic",
                          "url": None, "title": None}, schema_overrides={"url": pl.Utf8, "title": pl.Utf8})
    val = pl.DataFrame({"id": ["v0", "v1", "v2"], "text": val_texts, "source": "synthetic", "url": None,
                        "title": None}, schema_overrides={"url": pl.Utf8, "title": pl.Utf8})
    prepared = workdir / "data" / "prepared"
    (prepared / "train").mkdir(parents=True)
    train.head(260).write_parquet(prepared / "train" / "shard-00000.parquet")
    train.slice(260).write_parquet(prepared / "train" / "shard-00001.parquet")
    val.write_parquet(prepared / "val.parquet")
    return train, val


def test_curate_stage_equals_the_in_memory_recipe_for_every_ci_variant(prefect_harness, tmp_path):
    train, val = write_prepared(tmp_path)
    cfg = load_stage_config(CurationConfig, ROOT, "curation", "ci")
    assert cfg.shard_docs < train.height and cfg.decontamination.enabled  # several shards, decontaminated

    rows = curate_flow(root=str(ROOT), preset="ci", workdir=str(tmp_path))

    deco = ValDecontaminator.from_val(val["text"], cfg.decontamination)
    cache = FilterCache()
    curated = tmp_path / "data" / "curated"
    assert sorted(p.name for p in curated.iterdir()) == sorted(cfg.active)  # no engine parts left
    ctx = make_context(ROOT, preset="ci", workdir=tmp_path)
    client = mlflow.MlflowClient(ctx.tracking_uri)
    experiment = client.get_experiment_by_name(ctx.experiment).experiment_id
    for variant, row in zip(cfg.active, rows, strict=True):
        ref = run_recipe(train, cfg.variants[variant], filter_cache=cache, decontaminate=deco)
        folder = curated / variant
        assert sorted(p.name for p in folder.iterdir()) == ["dropped.parquet", "kept.parquet", "stats.json"]
        assert pl.read_parquet(folder / "kept.parquet").equals(ref.kept), variant
        assert pl.read_parquet(folder / "dropped.parquet").equals(ref.dropped), variant
        stats = json.loads((folder / "stats.json").read_text())
        assert stats == json.loads(json.dumps(ref.stats)) and tuple(stats) == VARIANT_STATS, variant
        assert row == variant_row(variant, ref.stats)
        assert stats["dropped_by_reason"]["val_contamination"] == 2  # d0100 and d0300, upper-cased in val
        # the store may be the test session's, holding other workdirs' curate runs: this workdir's one
        (run,) = [r for r in client.search_runs([experiment], f"attributes.run_name = 'curate:{variant}'")
                  if Path(r.data.tags.get(WORKDIR_TAG, "/nonexistent")).resolve() == tmp_path.resolve()]
        assert run.data.metrics["docs_kept"] == ref.stats["docs_kept"]
    dedup = json.loads((curated / "dedup_gopher" / "stats.json").read_text())["dropped_by_reason"]
    assert dedup["exact_dedup.duplicate"] == 3 and dedup["gopher_quality.word_count"] == 13
    # both per-document steps drop in every shard: dropped.parquet lists them step by step
    assert sum(n for r, n in dedup.items() if r.startswith("gopher_repetition")) == 8
    report = json.loads((tmp_path / "reports" / "curation.json").read_text())
    assert report == {r["variant"]: {k: v for k, v in r.items() if k != "variant"} for r in rows}
