"""Dedup against a persisted index through the sharded engine and ``scalelab curate --index``:
a new corpus loses its exact and near copies of the indexed one (``duplicate_of`` = the indexed
id), the index grows with kept documents, and the clusters equal one run over both corpora."""

from __future__ import annotations

import json
import random
from pathlib import Path

import polars as pl
import pytest

from flows.cli import main
from flows.curate import curate_any, read_dedup_index
from tasks.common.config import ConfigError
from tasks.curation.dedup import load_index
from tasks.curation.recipes import CurationConfig, DedupIndexConfig, Recipe, run_recipe, step
from tasks.curation.sharded import SerialExecutor, curate_corpus, read_inputs
from tests.tasks.curation.test_dedup import doc, mutate

ROOT = Path(__file__).resolve().parents[3]
MINHASH = {"threshold": 0.8, "bands": 28, "rows": 4}
RECIPE = Recipe(steps=(step("exact_dedup"), step("minhash", **MINHASH)))


def write_jsonl(path: Path, docs: dict[str, str]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return path


def write_recipe(path: Path, steps: str) -> Path:
    path.write_text(f"curation:\n  shard_docs: 3\n  variants:\n    dd: {{steps: {steps}}}\n")
    return path


@pytest.fixture()
def corpora(tmp_path):
    """A: ten distinct documents plus an exact copy of a03 (a10). B: copies of A (exact b00,
    near b01/b02/b06, b06 being near a03 whose copy A dropped), an exact pair inside B (b03/b04),
    and two new documents. C: a copy of B's kept b05 and a near copy of a02."""
    rng = random.Random(11)
    a = {f"a{i:02d}": doc(rng) for i in range(10)}
    a["a10"] = a["a03"].upper().replace(" ", "  ")
    b = {
        "b00": a["a01"].upper() + "!",
        "b01": mutate(a["a02"], rng, 2),
        "b02": mutate(a["a05"], rng, 3),
        "b03": (shared := doc(rng)),
        "b04": shared + " .",
        "b05": doc(rng),
        "b06": mutate(a["a03"], rng, 2),
        "b07": doc(rng),
    }
    c = {"c0": b["b05"].title(), "c1": mutate(a["a02"], rng, 1), "c2": doc(rng)}
    return {k: write_jsonl(tmp_path / f"{k}.jsonl", v) for k, v in (("a", a), ("b", b), ("c", c))}


def dropped_pairs(out: Path) -> dict[str, tuple[str, str]]:
    d = pl.read_parquet(out / "dropped.parquet")
    return {i: (r, o) for i, r, o in d.select("id", "reason", "duplicate_of").iter_rows()}


def kept_ids(out: Path) -> list[str]:
    return sorted(pl.read_parquet(out / "kept.parquet")["id"])


B_AGAINST_A = {
    "b00": ("exact_dedup.duplicate", "a01"),
    "b04": ("exact_dedup.duplicate", "b03"),
    "b01": ("minhash.near_duplicate", "a02"),
    "b02": ("minhash.near_duplicate", "a05"),
    "b06": ("minhash.near_duplicate", "a03"),
}


def test_new_corpus_deduplicated_against_index_equals_one_run_over_both(tmp_path, corpora):
    recipe = write_recipe(tmp_path / "r.yaml", json.dumps([{"exact_dedup": {}}, {"minhash": MINHASH}]))
    idx = tmp_path / "idx"
    sa = curate_any(inputs=[corpora["a"]], out=tmp_path / "A", recipe="dd", recipe_file=recipe, root=ROOT,
                    workers=1, index=idx, index_update=True)
    assert dropped_pairs(tmp_path / "A") == {"a10": ("exact_dedup.duplicate", "a03")}
    assert sa["index"] == {"path": str(idx), "docs_before": 0, "docs_added": 10, "docs_after": 10}
    index = load_index(idx)
    assert sorted(index.ids) == kept_ids(tmp_path / "A") and index.minhash_sig.shape == (10, 112)
    assert index.minhash_config["threshold"] == 0.8 and index.history[0]["docs_added"] == 10

    # B against A's index, read only
    sb = curate_any(inputs=[corpora["b"]], out=tmp_path / "B", recipe="dd", recipe_file=recipe, root=ROOT,
                    workers=1, index=idx)
    assert dropped_pairs(tmp_path / "B") == B_AGAINST_A
    assert [s.get("duplicates_of_index") for s in sb["steps"]] == [1, 3]
    assert sb["index"] == {"path": str(idx), "docs_before": 10, "docs_added": 0}
    assert json.loads((tmp_path / "B" / "stats.json").read_text())["dedup_index"]["docs"] == 10
    assert len(load_index(idx)) == 10  # not extended without update

    # the same clusters as one single-process run over A and B ("a*" ids sort before "b*")
    curate_corpus([corpora["a"], corpora["b"]], tmp_path / "AB", RECIPE, executor=SerialExecutor())
    assert dropped_pairs(tmp_path / "AB") == dropped_pairs(tmp_path / "A") | dropped_pairs(tmp_path / "B")
    assert kept_ids(tmp_path / "AB") == sorted(kept_ids(tmp_path / "A") + kept_ids(tmp_path / "B"))


def test_extend_the_index_then_dedup_a_third_corpus_and_refuse_a_rerun(tmp_path, corpora):
    recipe = write_recipe(tmp_path / "r.yaml", json.dumps([{"exact_dedup": {}}, {"minhash": MINHASH}]))
    idx = tmp_path / "idx"
    kw = dict(recipe="dd", recipe_file=recipe, root=ROOT, index=idx)
    curate_any(inputs=[corpora["a"]], out=tmp_path / "A", workers=1, index_update=True, **kw)
    # two workers: signatures for the index additions go through a process pool
    sb = curate_any(inputs=[corpora["b"]], out=tmp_path / "B", workers=2, index_update=True, **kw)
    assert dropped_pairs(tmp_path / "B") == B_AGAINST_A
    assert sb["index"] == {"path": str(idx), "docs_before": 10, "docs_added": 3, "docs_after": 13}
    index = load_index(idx)
    assert sorted(index.ids) == sorted(kept_ids(tmp_path / "A") + ["b03", "b05", "b07"])
    assert [h["docs_added"] for h in index.history] == [10, 3]

    curate_any(inputs=[corpora["c"]], out=tmp_path / "C", workers=1, **kw)
    assert dropped_pairs(tmp_path / "C") == {"c0": ("exact_dedup.duplicate", "b05"),
                                              "c1": ("minhash.near_duplicate", "a02")}

    # B was added: running it again against the grown index would drop it as copies of itself
    before = (tmp_path / "B" / "kept.parquet").read_bytes()
    with pytest.raises(ValueError, match=r"already indexed \(e.g. 'b03'\)"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "B", workers=1, index_update=True, **kw)
    assert (tmp_path / "B" / "kept.parquet").read_bytes() == before
    assert len(load_index(idx)) == 13


def test_finished_parts_are_reused_only_with_the_same_index(tmp_path, corpora):
    idx = tmp_path / "idx"
    curate_any(inputs=[corpora["a"]], out=tmp_path / "A", recipe="dd", root=ROOT, workers=1, index=idx,
               index_update=True, recipe_file=write_recipe(tmp_path / "r.yaml", json.dumps(
                   [{"exact_dedup": {}}, {"minhash": MINHASH}])))
    index = load_index(idx)
    first = curate_corpus([corpora["b"]], tmp_path / "B", RECIPE, executor=SerialExecutor(), index=index)
    again = curate_corpus([corpora["b"]], tmp_path / "B", RECIPE, executor=SerialExecutor(), index=index)
    assert again["run"] == {"shards_computed": 0, "shards_reused": first["run"]["shards_computed"]}
    # without the index the same folder must not reuse parts deduplicated against it
    plain = curate_corpus([corpora["b"]], tmp_path / "B", RECIPE, executor=SerialExecutor())
    assert plain["run"]["shards_reused"] == 0 and "b00" not in dropped_pairs(tmp_path / "B")


def test_index_refusals_name_the_problem(tmp_path, corpora):
    both = write_recipe(tmp_path / "r.yaml", json.dumps([{"exact_dedup": {}}, {"minhash": MINHASH}]))
    exact_only = write_recipe(tmp_path / "e.yaml", json.dumps([{"exact_dedup": {}}]))
    other = write_recipe(tmp_path / "o.yaml", json.dumps([{"minhash": {**MINHASH, "ngram": 4}}]))
    kw = dict(recipe="dd", root=ROOT, workers=1)
    with pytest.raises(ConfigError, match=r"index.json not found.*--index-update"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "o1", recipe_file=both, index=tmp_path / "none", **kw)
    assert not (tmp_path / "o1").exists()
    with pytest.raises(ConfigError, match="--index DIR"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "o1", recipe_file=both, index_update=True, **kw)
    curate_any(inputs=[corpora["a"]], out=tmp_path / "A", recipe_file=exact_only, index=tmp_path / "ix",
               index_update=True, **kw)
    with pytest.raises(ConfigError, match="no MinHash signatures"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "o2", recipe_file=both, index=tmp_path / "ix", **kw)
    curate_any(inputs=[corpora["a"]], out=tmp_path / "A2", recipe_file=both, index=tmp_path / "iy",
               index_update=True, **kw)
    with pytest.raises(ConfigError, match=r"\['ngram'\] differ"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "o3", recipe_file=other, index=tmp_path / "iy", **kw)
    (tmp_path / "iy" / "minhash.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"minhash.parquet: not a readable Parquet"):
        curate_any(inputs=[corpora["b"]], out=tmp_path / "o4", recipe_file=both, index=tmp_path / "iy", **kw)
    # an exact-only index still deduplicates exact copies, and an index-less minhash recipe is
    # extended with signatures only when the index has them
    curate_any(inputs=[corpora["b"]], out=tmp_path / "B", recipe_file=exact_only, index=tmp_path / "ix", **kw)
    assert dropped_pairs(tmp_path / "B") == {k: v for k, v in B_AGAINST_A.items() if v[0].startswith("exact")}


def test_cli_index_flags(tmp_path, corpora, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", json.dumps([{"exact_dedup": {}}, {"minhash": MINHASH}]))
    base = ["curate", "--recipe", "dd", "--recipe-file", str(recipe), "--workers", "1", "--root", str(ROOT),
            "--index", str(tmp_path / "idx")]
    assert main([*base, "--input", str(corpora["a"]), "--out", str(tmp_path / "A"), "--index-update"]) == 0
    assert main([*base, "--input", str(corpora["b"]), "--out", str(tmp_path / "B")]) == 0
    out = capsys.readouterr().out
    assert "0 documents dropped as duplicates of its 0; 10 added (10 indexed)" in out
    assert "4 documents dropped as duplicates of its 10" in out
    assert dropped_pairs(tmp_path / "B") == B_AGAINST_A


def test_pipeline_reads_an_index_but_does_not_extend_it(tmp_path, corpora):
    docs, _ = read_inputs([corpora["a"]])
    idx = tmp_path / "idx"
    curate_any(inputs=[corpora["a"]], out=tmp_path / "A", recipe="dd", root=ROOT, workers=1, index=idx,
               index_update=True, recipe_file=write_recipe(tmp_path / "r.yaml", json.dumps(
                   [{"exact_dedup": {}}, {"minhash": MINHASH}])))
    b, _ = read_inputs([corpora["b"]])
    cfg = CurationConfig(active=("dd",), variants={"dd": RECIPE}, index=DedupIndexConfig(path=str(idx)))
    res = run_recipe(b, RECIPE, index=read_dedup_index(cfg, b))
    got = {i: (r, o) for i, r, o in res.dropped.select("id", "reason", "duplicate_of").iter_rows()}
    assert got == B_AGAINST_A
    with pytest.raises(ConfigError, match="already indexed"):
        read_dedup_index(cfg, docs)
    with pytest.raises(ConfigError, match="curation.index.update"):
        read_dedup_index(CurationConfig(active=("dd",), variants={"dd": RECIPE},
                                        index=DedupIndexConfig(path=str(idx), update=True)), b)
    with pytest.raises(ValueError, match="update"):
        DedupIndexConfig(update=True)
