"""Validation decontamination on hand-made documents: word 13-gram containment, short documents,
the step inside a recipe, and its counts in the curation report."""

from __future__ import annotations

import polars as pl
import pytest

from tasks.common.config import ConfigError, from_mapping
from tasks.curation.decontam import REASON, DecontaminationConfig, ValDecontaminator, word_ngram_hashes
from tasks.curation.recipes import Recipe, run_recipe, step

WORDS = [f"w{i}" for i in range(200)]
VAL_DOC = " ".join(WORDS[:40])          # 40 words: 28 distinct 13-grams
OTHER = " ".join(WORDS[100:160])        # shares no 13-gram with validation


def decontaminator(threshold=0.5, ngram=13, val=(VAL_DOC, "a short tweet here")):
    return ValDecontaminator.from_val(pl.Series(list(val)), DecontaminationConfig(ngram=ngram, threshold=threshold))


def test_containment_is_the_share_of_a_documents_distinct_ngrams_found_in_validation():
    deco = decontaminator()
    half = " ".join(WORDS[:26] + WORDS[100:126])  # 14 of its 40 windows are validation 13-grams
    texts = pl.Series([
        VAL_DOC.upper().replace(" ", ", "),   # case and punctuation do not hide a copy
        OTHER,
        half,
        (VAL_DOC + " ") * 3,                  # 28 val windows (each counted once) + 12 across the seams
        "",
    ])
    c = deco.contamination(texts)
    assert c[0] == pytest.approx(1.0) and c[1] == 0.0 and c[3] == pytest.approx(28 / 40) and c[4] == 0.0
    assert c[2] == pytest.approx(14 / 40)


def test_threshold_decides_and_drops_carry_the_reason():
    texts = pl.Series([VAL_DOC, OTHER, " ".join(WORDS[:26] + WORDS[100:126])])
    assert decontaminator(0.5)(texts).reasons.to_list() == [REASON, None, None]
    assert decontaminator(0.3)(texts).reasons.to_list() == [REASON, None, REASON]


def test_a_short_document_is_removed_only_when_its_words_equal_a_short_validation_document():
    deco = decontaminator()
    texts = pl.Series(["A SHORT tweet, here!", "a short tweet", "a short tweet here too"])
    assert deco(texts).reasons.to_list() == [REASON, None, None]


def test_ngrams_never_span_two_documents():
    # the last words of one document and the first of the next would form validation's 13-gram
    left, right = " ".join(WORDS[:6]), " ".join(WORDS[6:13])
    hashes, doc, n_words = word_ngram_hashes(pl.Series([left, right, " ".join(WORDS[:13])]), 13)
    assert n_words.tolist() == [6, 7, 13]
    full = hashes[doc == 2]
    assert len(full) == 1 and full[0] not in set(hashes[doc < 2].tolist())


def test_val_share_counts_validation_ngrams_seen_in_training():
    deco = decontaminator(val=(VAL_DOC,))
    assert deco.val_share(pl.Series([OTHER])) == 0.0
    assert deco.val_share(pl.Series([" ".join(WORDS[:26])])) == pytest.approx(14 / 28)
    assert deco.val_share(pl.Series([VAL_DOC])) == 1.0


def test_recipe_step_drops_copies_after_the_recipe_and_reconciles_counts():
    docs = pl.DataFrame({
        "id": ["copy", "clean", "dup_of_clean", "quote"],
        "text": [VAL_DOC.title(), OTHER, OTHER, "intro " + " ".join(WORDS[:14]) + " " + " ".join(WORDS[150:199])],
        "source": ["s1", "s1", "s2", "s2"],
    })
    recipe = Recipe(steps=(step("exact_dedup"),))
    res = run_recipe(docs, recipe, decontaminate=decontaminator())
    assert sorted(res.kept["id"].to_list()) == ["clean", "quote"]  # a short quote of val stays
    by_reason = res.stats["dropped_by_reason"]
    assert by_reason[REASON] == 1 and sum(by_reason.values()) == 2
    info = res.stats["steps"][-1]
    assert info["kind"] == "val_decontamination" and info["docs_in"] - info["docs_out"] == 1
    assert info["val_ngram_share_before"] == 1.0 and info["val_ngram_share_after"] == pytest.approx(2 / 28)


def test_variant_row_reports_decontaminated_documents():
    from flows.curate import variant_row

    docs = pl.DataFrame({"id": ["a", "b"], "text": [VAL_DOC, OTHER], "source": ["s", "s"]})
    res = run_recipe(docs, Recipe(), decontaminate=decontaminator())
    row = variant_row("raw", res.stats)
    assert row["val_decontaminated"] == 1 and row[f"dropped.{REASON}"] == 1
    assert row["val_ngram_share_before"] == 1.0 and row["val_ngram_share_after"] == 0.0


@pytest.mark.parametrize("key, value", [("threshold", 0.0), ("threshold", 1.5), ("ngram", 0)])
def test_config_rejects(key, value):
    with pytest.raises(ConfigError, match=key):
        from_mapping(DecontaminationConfig, {key: value}, source="curation.yaml", prefix="curation.decontamination")
