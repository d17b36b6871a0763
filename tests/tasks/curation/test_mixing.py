"""Mixing rewritten and original text at a token ratio (QualityPajama's 100/0, 67/33, 33/67)."""

from __future__ import annotations

import polars as pl
import pytest

from tasks.curation.recipes import Recipe, run_recipe, step
from tasks.curation.rewrite import REWRITE_SCHEMA

N = 60
DOCS = pl.DataFrame({
    "id": [f"d{i:02d}" for i in range(N)],
    # Lengths vary (5..64 words) so the ratio is not a doc count in disguise.
    "text": [" ".join(f"w{i}" for _ in range(5 + i)) for i in range(N)],
    "source": ["s"] * N,
})


def fake_rewriter(covered: float = 1.0):
    """Rewrites the first ``covered`` share of documents as 'rewritten <n words>' (shorter text)."""

    def rewrite(docs: pl.DataFrame, style: str, budget: int | None) -> pl.DataFrame:
        n = int(docs.height * covered) if budget is None else min(budget, int(docs.height * covered))
        ids, texts = docs["id"].to_list(), docs["text"].to_list()
        rows = {
            "id": ids, "style": [style] * len(ids),
            "text": [f"rewritten {style} " + " ".join(t.split()[: len(t.split()) // 2]) if i < n else t
                     for i, t in enumerate(texts)],
            "rewritten": [i < n for i in range(len(ids))],
            "error": [None if i < n else "budget" for i in range(len(ids))],
            "finish_reason": ["stop" if i < n else None for i in range(len(ids))],
            "generator": ["fake"] * len(ids),
        }
        return pl.DataFrame(rows, schema=REWRITE_SCHEMA)

    return rewrite


def share(kept: pl.DataFrame) -> float:
    words = kept["text"].str.count_matches(r"\S+")
    return float(words.filter(kept["rewrite"].is_not_null()).sum() / words.sum())


def mix_recipe(ratio: float, style: str = "hq", seed: int = 0) -> Recipe:
    return Recipe(steps=(step("rewrite", style=style), step("mix", rewritten=ratio, seed=seed)))


@pytest.mark.parametrize("ratio", [0.33, 0.67])
@pytest.mark.parametrize("covered", [1.0, 0.5])
def test_token_share_close_to_target(ratio, covered):
    res = run_recipe(DOCS, mix_recipe(ratio), rewriter=fake_rewriter(covered))
    kept, s = res.kept, res.stats
    assert s["docs_in"] == s["docs_kept"] + s["docs_dropped"]
    assert kept["id"].n_unique() == kept.height  # one version per document
    longest = 64  # one document's words: the greedy choice moves in steps of one document
    total = kept["text"].str.count_matches(r"\S+").sum()
    assert abs(share(kept) - ratio) <= longest / total
    mix_info = s["steps"][-1]
    assert mix_info["step"] == "mix" and mix_info["mix_rewritten_share"] == pytest.approx(share(kept))
    # Rewritten docs carry the style; originals carry null and their input text.
    orig = kept.filter(pl.col("rewrite").is_null()).join(DOCS, on="id")
    assert (orig["text"] == orig["text_right"]).all()
    assert set(kept.filter(pl.col("rewrite").is_not_null())["text"].str.slice(0, 12)) == {"rewritten hq"}


def test_full_rewrite_drops_unrewritten_originals():
    res = run_recipe(DOCS, mix_recipe(1.0), rewriter=fake_rewriter(0.5))
    assert res.kept["rewrite"].is_not_null().all() and res.kept.height == N // 2
    assert set(res.dropped["reason"]) == {"mix.over_ratio"}
    assert res.dropped.height == N // 2


def test_low_ratio_with_everything_rewritten_reverts_instead_of_dropping():
    res = run_recipe(DOCS, mix_recipe(0.33), rewriter=fake_rewriter(1.0))
    assert res.dropped.height == 0 and res.kept.height == N


def test_zero_ratio_and_determinism():
    zero = run_recipe(DOCS, mix_recipe(0.0), rewriter=fake_rewriter(1.0))
    assert zero.kept["rewrite"].is_null().all() and zero.kept.select("id", "text").equals(DOCS.select("id", "text"))
    a = run_recipe(DOCS, mix_recipe(0.67), rewriter=fake_rewriter(0.5))
    b = run_recipe(DOCS, mix_recipe(0.67), rewriter=fake_rewriter(0.5))
    assert a.kept.equals(b.kept) and a.dropped.equals(b.dropped)
    c = run_recipe(DOCS, mix_recipe(0.67, seed=5), rewriter=fake_rewriter(0.5))
    assert set(c.dropped["id"]) != set(a.dropped["id"])


def test_token_count_function_is_used():
    chars = lambda s: s.fill_null("").str.len_chars().cast(pl.Int64)  # noqa: E731
    res = run_recipe(DOCS, mix_recipe(0.5), rewriter=fake_rewriter(1.0), token_count=chars)
    lens = res.kept["text"].str.len_chars()
    got = lens.filter(res.kept["rewrite"].is_not_null()).sum() / lens.sum()
    assert abs(got - 0.5) <= 400 / lens.sum()
    assert res.stats["tokens_in"] == DOCS["text"].str.len_chars().sum()


def test_rewrite_without_mix_replaces_text_where_rewritten():
    res = run_recipe(DOCS, Recipe(steps=(step("rewrite", style="qa", budget=10),)), rewriter=fake_rewriter(1.0))
    assert res.kept.height == N and res.stats["docs_rewritten"] == 10
    assert res.kept["text"].str.starts_with("rewritten qa").sum() == 10


def test_mix_without_any_rewrite_is_an_error():
    with pytest.raises(ValueError, match="no document has a successful rewrite"):
        run_recipe(DOCS, mix_recipe(0.67), rewriter=fake_rewriter(0.0))
