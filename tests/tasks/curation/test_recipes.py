"""Recipes: parsing with file/key errors, reasons per dropped document, and reconciliation."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config
from tasks.curation.recipes import (
    CurationConfig,
    DROPPED_SCHEMA,
    FilterCache,
    KEPT_SCHEMA,
    Recipe,
    Step,
    run_recipe,
    step,
    step_kinds,
)

# The checkout (not `from tests.conftest import ROOT`: importing the conftest a second time reruns
# it and moves the session's PREFECT_HOME).
ROOT = Path(__file__).resolve().parents[3]

PROSE = (
    "The committee met on Tuesday to discuss the new budget for the city and its schools. "
    "Members agreed that the plan should be published before the end of the month. "
    "Several residents asked questions about the cost of repairs to the old bridge. "
    "The mayor said that the work would start in the spring and finish by the autumn. "
    "A final vote is expected next week, after the public has had time to comment."
)


def corpus() -> pl.DataFrame:
    texts = [
        PROSE,
        PROSE.replace("Tuesday", "Monday"),
        PROSE,                                   # exact duplicate of doc 0
        "buy now!!! click here",                 # too short for Gopher
        PROSE.replace("city", "town") + "\nAccept our cookie policy to continue",
        "word " * 80,                            # repetitive
        PROSE.replace("bridge", "tunnel"),
        PROSE.replace("bridge", "tunnel"),       # exact duplicate of doc 6
    ]
    return pl.DataFrame({"id": [f"doc{i}" for i in range(len(texts))], "text": texts,
                         "source": ["test"] * len(texts)})


def test_reconciliation_reasons_and_duplicate_of():
    docs = corpus()
    recipe = Recipe(steps=(step("exact_dedup"), step("gopher_quality"), step("gopher_repetition")))
    res = run_recipe(docs, recipe)
    assert res.kept.schema == pl.Schema(KEPT_SCHEMA) and res.dropped.schema == pl.Schema(DROPPED_SCHEMA)
    s = res.stats
    assert s["docs_in"] == 8 == s["docs_kept"] + s["docs_dropped"]
    assert set(res.kept["id"]) | set(res.dropped["id"]) == set(docs["id"])
    assert set(res.kept["id"]).isdisjoint(res.dropped["id"])
    dups = res.dropped.filter(pl.col("reason") == "exact_dedup.duplicate")
    assert dict(zip(dups["id"], dups["duplicate_of"])) == {"doc2": "doc0", "doc7": "doc6"}
    reasons = dict(zip(res.dropped["id"], res.dropped["reason"]))
    assert reasons["doc3"].startswith("gopher_quality.")
    assert reasons["doc5"].startswith(("gopher_quality.", "gopher_repetition."))
    assert sum(s["dropped_by_reason"].values()) == s["docs_dropped"]
    assert [x["step"] for x in s["steps"]] == ["exact_dedup", "gopher_quality", "gopher_repetition"]
    assert s["steps"][0]["docs_in"] == 8 and s["steps"][0]["docs_out"] == 6
    assert s["words_kept"] < s["words_in"]
    # Kept documents keep their input order and columns.
    assert res.kept["id"].to_list() == [i for i in docs["id"] if i in set(res.kept["id"])]
    assert res.kept["source"].to_list() == ["test"] * res.kept.height


def test_raw_recipe_keeps_everything():
    docs = corpus()
    res = run_recipe(docs, Recipe())
    assert res.kept.select("id", "text").equals(docs.select("id", "text"))
    assert res.dropped.height == 0 and res.stats["tokens_in"] == res.stats["tokens_kept"]


def test_c4_edits_kept_text_and_drops_keep_original():
    docs = corpus()
    res = run_recipe(docs, Recipe(steps=(step("c4_quality"),)))
    kept = dict(zip(res.kept["id"], res.kept["text"]))
    assert "cookie policy" not in kept.get("doc4", "")
    assert "doc4" in kept  # the boilerplate line goes, the document stays
    for row in res.dropped.iter_rows(named=True):
        assert row["text"] == docs.filter(pl.col("id") == row["id"])["text"][0]
        assert row["reason"].startswith("c4_quality.")
    assert res.stats["docs_in"] == res.stats["docs_kept"] + res.stats["docs_dropped"]


def test_duplicate_ids_rejected():
    docs = pl.DataFrame({"id": ["a", "a"], "text": ["x y", "z w"]})
    with pytest.raises(ValueError, match="unique"):
        run_recipe(docs, Recipe())


def _write_params(root, body: str) -> None:
    (root / "params").mkdir()
    (root / "params" / "curation.yaml").write_text(body)


def test_unknown_step_names_file_and_key(tmp_path):
    _write_params(tmp_path, "curation:\n  active: [x]\n  variants:\n    x:\n      steps: [{gopher_qualty: {}}]\n")
    with pytest.raises(ConfigError, match=r"curation\.yaml.*curation\.variants\.x\.steps\[0\]\.gopher_qualty: unknown key"):
        load_stage_config(CurationConfig, tmp_path, "curation", "demo")


def test_unknown_setting_names_file_and_key(tmp_path):
    _write_params(tmp_path, "curation:\n  active: [x]\n  variants:\n    x:\n"
                            "      steps: [{minhash: {treshold: 0.8}}]\n")
    with pytest.raises(ConfigError, match=r"curation\.yaml.*curation\.variants\.x\.steps\[0\]\.minhash\.treshold"):
        load_stage_config(CurationConfig, tmp_path, "curation", "demo")


def test_bad_recipes_rejected(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        Step()
    with pytest.raises(ValueError, match="exactly one"):
        Step(**{k: v for k, v in [("exact_dedup", step("exact_dedup").exact_dedup),
                                  ("mix", step("mix", rewritten=0.5).mix)]})
    with pytest.raises(ValueError, match="mix step needs a rewrite"):
        Recipe(steps=(step("mix", rewritten=0.5),))
    with pytest.raises(ValueError, match="style"):
        step("rewrite", style="poetry")
    _write_params(tmp_path, "curation:\n  active: [nope]\n  variants:\n    x: {steps: []}\n")
    with pytest.raises(ConfigError, match=r"curation\.yaml.*active.*unknown variant"):
        load_stage_config(CurationConfig, tmp_path, "curation", "demo")
    with pytest.raises(ValueError, match="rewriter="):
        run_recipe(corpus(), Recipe(steps=(step("rewrite", style="hq"),)))


@pytest.mark.parametrize("preset", PRESETS)
def test_params_file_loads(preset):
    cfg = load_stage_config(CurationConfig, ROOT, "curation", preset)
    required = {"raw", "exact_dedup", "minhash_0.7", "minhash_0.8", "minhash_0.9", "gopher", "c4", "fineweb",
                "dedup_gopher_c4", "rewrite_hq_mix67"}
    assert required <= set(cfg.variants)
    kinds = {s.kind for v in cfg.active for s in cfg.recipe(v).steps}
    if preset == "ci":
        assert len(cfg.active) == 2 and "rewrite" not in kinds  # SmolLM2 on CPU: too slow for CI
    elif preset == "demo":
        # every kind of intervention, with rewriting capped per run (SmolLM2 takes ~12 s a document on CPU)
        assert {"exact_dedup", "minhash", "gopher_quality", "c4_quality", "fineweb_quality", "aesthetic",
                "rewrite", "mix"} <= kinds
        assert cfg.rewrite.max_docs_per_run is not None and cfg.rewrite.max_docs_per_run <= 8
    else:
        assert len(cfg.active) >= 12 and cfg.rewrite.max_docs_per_run is None
    assert all(k in step_kinds() for v in cfg.variants.values() for k in (s.kind for s in v.steps))


def test_filter_cache_gives_the_same_result_and_judges_each_text_once(monkeypatch):
    from tasks.curation import filters as F

    judged = []
    fn = F.FILTERS["gopher_quality"][1]
    cls = F.FILTERS["gopher_quality"][0]
    monkeypatch.setitem(F.FILTERS, "gopher_quality", (cls, lambda t, c: judged.extend(t.to_list()) or fn(t, c)))
    docs = corpus()
    gopher = Recipe(steps=(step("gopher_quality"), step("c4_quality")))
    dedup_gopher = Recipe(steps=(step("exact_dedup"), step("gopher_quality"), step("c4_quality")))
    cache = FilterCache()
    for recipe in (gopher, dedup_gopher):
        plain, cached = run_recipe(docs, recipe), run_recipe(docs, recipe, filter_cache=cache)
        assert plain.kept.equals(cached.kept) and plain.dropped.equals(cached.dropped)
        assert plain.stats == cached.stats
    # plain runs judged 8 + 6 texts; the cache judged the 6 distinct texts once, for both recipes
    assert len(judged) == 8 + 6 + 6 and len(set(judged[-6:])) == 6
    # C4 edits text (line removal): the cached edit is what a kept document carries
    edited = cached.kept.filter(pl.col("id") == "doc4")["text"][0]
    assert "cookie" not in edited
