"""Sharded curation: global dedup across shards, crash-resume, and parallel == serial output."""

from __future__ import annotations

import json

import polars as pl
import pytest

from tasks.curation import sharded
from tasks.curation.prepare import drop_duplicate_ids
from tasks.curation.recipes import Recipe, run_recipe, step
from tasks.curation.sharded import SerialExecutor, curate_corpus, read_inputs
from tests.tasks.curation.frame_watch import watch_document_frames
from tests.tasks.curation.test_recipes import PROSE

RECIPE = Recipe(steps=(step("gopher_quality"), step("exact_dedup"), step("c4_quality")))
OUTPUTS = ("kept.parquet", "dropped.parquet", "quarantine.parquet", "stats.json")


def write_corpus(path) -> str:
    lines = []
    for i in range(40):
        if i % 9 == 4:
            text = "too short"
        elif i % 10 == 7:
            text = PROSE  # the same text at i = 7, 17, 27, 37: duplicates across shards
        else:
            text = PROSE.replace("bridge", f"bridge number {i}")
        if i == 12:
            text += "\nPlease enable javascript to view this page"
        lines.append(json.dumps({"id": f"u{i}", "text": text}))
    lines.insert(5, "{not json")
    lines.insert(20, json.dumps({"id": "empty", "text": "  "}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def read_outputs(out):
    frames = {name: pl.read_parquet(out / name) for name in OUTPUTS if name.endswith(".parquet")}
    frames["stats.json"] = (out / "stats.json").read_text()
    return frames


def assert_same_outputs(a, b):
    for name in OUTPUTS:
        if name.endswith(".parquet"):
            assert a[name].equals(b[name]), name
        else:
            assert a[name] == b[name]


def test_sharded_equals_single_process_and_global_across_shards(tmp_path):
    src = write_corpus(tmp_path / "in.jsonl")
    stats = curate_corpus([src], tmp_path / "out", RECIPE, shard_docs=6, executor=SerialExecutor())
    out = read_outputs(tmp_path / "out")
    docs, _ = read_inputs([src])
    ref = run_recipe(docs, RECIPE)
    assert out["kept.parquet"].equals(ref.kept)
    assert out["dropped.parquet"].sort("id").equals(ref.dropped.sort("id"))
    # u7, u17, u27, u37 sit in different shards; the lowest id in string order ("u17") survives,
    # whichever shard it sits in.
    dups = out["dropped.parquet"].filter(pl.col("reason") == "exact_dedup.duplicate")
    assert sorted(dups["id"]) == ["u27", "u37", "u7"] and set(dups["duplicate_of"]) == {"u17"}
    q = out["quarantine.parquet"]
    assert sorted(zip(q["line"], q["reason"])) == [(6, "invalid_json"), (21, "empty_text")]
    assert set(q["file"]) == {"in.jsonl"}
    assert stats["records_read"] == 42 == stats["docs_kept"] + stats["docs_dropped"] + stats["quarantined"]
    assert json.loads(out["stats.json"])["docs_in"] == 40
    assert "javascript" not in " ".join(out["kept.parquet"]["text"])
    assert stats["run"] == {"shards_computed": 7 + 1 + 6, "shards_reused": 0}


def test_crash_then_resume_redoes_only_unfinished_shards(tmp_path, monkeypatch):
    src = write_corpus(tmp_path / "in.jsonl")
    clean = tmp_path / "clean"
    curate_corpus([src], clean, RECIPE, shard_docs=6, executor=SerialExecutor())

    real = sharded._run_local_shard
    calls = []

    def crash_after_three(shard, steps, folder, *rest):
        calls.append(folder)
        if len(calls) > 3:
            raise RuntimeError("worker killed")
        return real(shard, steps, folder, *rest)

    monkeypatch.setattr(sharded, "_run_local_shard", crash_after_three)
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="shards failed"):
        curate_corpus([src], crashed, RECIPE, shard_docs=6, executor=SerialExecutor())
    assert not (crashed / "kept.parquet").exists()
    assert len(list((crashed / ".shards").glob("*/*/DONE"))) == 3

    monkeypatch.setattr(sharded, "_run_local_shard", real)
    stats = curate_corpus([src], crashed, RECIPE, shard_docs=6, executor=SerialExecutor())
    assert stats["run"] == {"shards_computed": 4 + 1 + 6, "shards_reused": 3}
    assert_same_outputs(read_outputs(clean), read_outputs(crashed))

    again = curate_corpus([src], crashed, RECIPE, shard_docs=6, executor=SerialExecutor())
    assert again["run"] == {"shards_computed": 0, "shards_reused": 14}

    # A different recipe must not reuse the old parts.
    other = Recipe(steps=(step("gopher_quality"),))
    changed = curate_corpus([src], crashed, other, shard_docs=6, executor=SerialExecutor())
    assert changed["run"]["shards_reused"] == 0
    assert set(changed["dropped_by_reason"]) == {r for r in changed["dropped_by_reason"] if r.startswith("gopher")}


def test_process_pool_equals_serial(tmp_path):
    src = write_corpus(tmp_path / "in.jsonl")
    curate_corpus([src], tmp_path / "serial", RECIPE, shard_docs=6, executor=SerialExecutor())
    curate_corpus([src], tmp_path / "pool", RECIPE, shard_docs=6, n_workers=2)
    assert_same_outputs(read_outputs(tmp_path / "serial"), read_outputs(tmp_path / "pool"))


def test_parquet_input_and_errors(tmp_path):
    p = tmp_path / "in.parquet"
    pl.DataFrame({"text": [PROSE, PROSE, None], "id": ["a", "b", "c"]}).write_parquet(p)
    stats = curate_corpus([str(p)], tmp_path / "o", Recipe(steps=(step("exact_dedup"),)), n_workers=1)
    assert stats["docs_kept"] == 1 and stats["quarantined_by_reason"] == {"missing_text": 1}
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        curate_corpus([str(tmp_path / "nothere.jsonl")], tmp_path / "o2", Recipe(), n_workers=1)
    with pytest.raises(ValueError, match="rewriter="):
        curate_corpus([str(p)], tmp_path / "o3", Recipe(steps=(step("rewrite", style="hq"),)), n_workers=1)


def test_gzip_input_and_glob_curate_like_plain_jsonl(tmp_path):
    import gzip

    src = write_corpus(tmp_path / "in.jsonl")
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "in.jsonl.gz").write_bytes(gzip.compress((tmp_path / "in.jsonl").read_bytes()))
    curate_corpus([src], tmp_path / "plain", RECIPE, shard_docs=6, executor=SerialExecutor())
    stats = curate_corpus([str(tmp_path / "gz" / "*.jsonl.gz")], tmp_path / "gzout", RECIPE, shard_docs=6,
                          executor=SerialExecutor())
    plain, gz = read_outputs(tmp_path / "plain"), read_outputs(tmp_path / "gzout")
    assert gz["kept.parquet"].equals(plain["kept.parquet"]) and gz["dropped.parquet"].equals(plain["dropped.parquet"])
    assert stats["quarantined_by_reason"] == {"invalid_json": 1, "empty_text": 1}
    with pytest.raises(ValueError, match=r"in.jsonl.bz2: unknown format; expected .jsonl \(.jsonl.gz, .jsonl.zst\)"):
        curate_corpus([str(tmp_path / "in.jsonl.bz2")], tmp_path / "bad", RECIPE, executor=SerialExecutor())


NEAR_RECIPE = Recipe(steps=(step("gopher_repetition"), step("exact_dedup"),
                            step("minhash", threshold=0.8, bands=28, rows=4), step("c4_quality")))


def write_near_duplicate_corpus(tmp_path) -> list[str]:
    """Two JSONL files and one Parquet file (73 documents): exact and near copies of earlier
    documents, each in a later shard at shard_docs=8, some copies with ids sorting before their
    original's (so the copy is the one kept), a repeated id, a bad line and a document without
    text."""
    import random

    from tests.tasks.curation.test_dedup import doc, mutate

    rng = random.Random(5)
    base = {f"m{i:03d}": doc(rng, 120) for i in range(50)}
    docs = dict(base)
    for i, src in enumerate(rng.sample(sorted(base), 12)):
        docs[f"n{i:03d}"] = mutate(base[src], rng, 2)  # near copy, a later shard
    for i, src in enumerate(rng.sample(sorted(base), 6)):
        docs[f"e{i:03d}"] = base[src].upper().replace(" ", "  ")  # exact copy, "e" sorts before "m"
    docs["n100"] = mutate(docs["n000"], rng, 1)  # a near copy of a near copy
    rows = [{"id": k, "text": v} for k, v in docs.items()]
    first, second, third = rows[:30], rows[30:55], rows[55:]
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in first) + "{broken\n")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps(r) + "\n" for r in second) + json.dumps({"id": "m001", "text": "again"}) + "\n")
    c = tmp_path / "c.parquet"
    pl.DataFrame(third + [{"id": "none", "text": None}]).write_parquet(c)
    return [str(a), str(b), str(c)]


@pytest.mark.parametrize("n_workers", [1, 2], ids=["serial", "pool"])
def test_streaming_engine_equals_in_memory_recipe_across_shards(tmp_path, n_workers):
    """The streaming engine's kept, dropped (with duplicate_of) and counts are those of the
    in-memory recipe (the engine's former behaviour) over the whole corpus read at once."""
    inputs = write_near_duplicate_corpus(tmp_path)
    stats = curate_corpus(inputs, tmp_path / "out", NEAR_RECIPE, shard_docs=8, n_workers=n_workers)
    out = read_outputs(tmp_path / "out")
    docs, quarantine = read_inputs(inputs)
    docs, dup_ids = drop_duplicate_ids(docs)
    ref = run_recipe(docs, NEAR_RECIPE)
    assert out["kept.parquet"].equals(ref.kept)
    assert out["dropped.parquet"].equals(ref.dropped)  # same order too: segment by segment, input order
    assert out["quarantine.parquet"].equals(pl.concat([quarantine, dup_ids]))
    near = out["dropped.parquet"].filter(pl.col("reason") == "minhash.near_duplicate")
    exact = out["dropped.parquet"].filter(pl.col("reason") == "exact_dedup.duplicate")
    assert near.height >= 10 and exact.height == 6  # the property is exercised across shards
    assert set(exact["id"]).isdisjoint(exact["duplicate_of"])  # the lowest id survives: e* over m*
    after_dedup = stats["steps"][2]["docs_out"]
    assert stats["run"]["shards_computed"] == -(-stats["docs_in"] // 8) + 1 + 1 + -(-after_dedup // 8)
    for key in ("docs_in", "docs_kept", "docs_dropped", "words_in", "words_kept", "tokens_in", "tokens_kept",
                "dropped_by_reason", "steps"):
        assert stats[key] == ref.stats[key], key
    assert stats["quarantined_by_reason"] == {"invalid_json": 1, "missing_text": 1, "duplicate_id": 1}


def test_main_process_holds_at_most_two_shards_of_documents(tmp_path, monkeypatch):
    """With workers in other processes, no frame of documents built, read or written by the
    main process is larger than two shards, while the corpus is ten shards."""
    inputs = write_near_duplicate_corpus(tmp_path)
    largest = watch_document_frames(monkeypatch, sharded)
    stats = curate_corpus(inputs, tmp_path / "out", NEAR_RECIPE, shard_docs=6, n_workers=2)
    assert stats["docs_in"] >= 10 * 6
    assert 6 <= largest[0] <= 2 * 6
    # the same watch sees the whole corpus when it is read in one piece
    read_inputs(inputs)
    assert largest[0] >= stats["docs_in"]


@pytest.mark.parametrize("n_workers", [1, 2], ids=["serial", "pool"])
def test_decontamination_and_filter_cache_equal_the_in_memory_recipe(tmp_path, n_workers):
    """Validation decontamination run shard by shard on the final texts drops what
    ``run_recipe(decontaminate=...)`` drops, after the recipe's drops, with the same validation
    n-gram shares (found-masks of shards combined, not shares averaged); a filter cache shared
    by two recipes changes nothing."""
    from tasks.curation.decontam import DecontaminationConfig, ValDecontaminator
    from tasks.curation.recipes import FilterCache

    inputs = write_near_duplicate_corpus(tmp_path)
    docs, _ = read_inputs(inputs)
    docs, _ = drop_duplicate_ids(docs)
    by_id = dict(zip(docs["id"], docs["text"]))
    words = by_id["m040"].split()
    # two whole copies in different shards (share 1: dropped) and half of one document (share 0.44: kept)
    val = pl.Series([by_id["m003"], by_id["m030"], " ".join(words[:60] + ["unrelated"] * 60), "a short one"])
    deco = ValDecontaminator.from_val(val, DecontaminationConfig(ngram=13, threshold=0.5))
    cache = FilterCache()
    for recipe in (Recipe(steps=NEAR_RECIPE.steps[:3]), Recipe(steps=(step("gopher_repetition"),))):
        out = tmp_path / f"out-{len(recipe.steps)}"
        stats = curate_corpus(inputs, out, recipe, shard_docs=8, n_workers=n_workers, decontaminate=deco,
                              filter_cache=cache)
        ref = run_recipe(docs, recipe, decontaminate=deco)
        got = read_outputs(out)
        assert got["kept.parquet"].equals(ref.kept)
        assert got["dropped.parquet"].equals(ref.dropped)
        assert set(got["dropped.parquet"].filter(pl.col("reason") == "val_contamination")["id"]) >= {"m003", "m030"}
        deco_step = stats["steps"][-1]
        assert deco_step["kind"] == "val_decontamination"
        assert 0 < deco_step["val_ngram_share_after"] < deco_step["val_ngram_share_before"] < 1
        for key in ("docs_in", "docs_kept", "docs_dropped", "tokens_kept", "dropped_by_reason", "steps"):
            assert stats[key] == ref.stats[key], key
