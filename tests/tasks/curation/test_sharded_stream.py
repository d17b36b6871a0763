"""The sharded engine's rewrite and mix steps stream shard by shard and equal the in-memory recipe:
the rewriter is called one shard at a time with the budget left, the mix decides on per-document
keys and is applied per shard."""

from __future__ import annotations

import json

import polars as pl
import pytest

from tasks.curation import recipes, sharded
from tasks.curation.recipes import MIX_KEYS_SCHEMA, Recipe, run_recipe, step
from tasks.curation.rewrite import DocumentRewriter
from tasks.curation.sharded import curate_corpus, read_inputs
from tests.tasks.curation.frame_watch import watch_document_frames

SHARD = 4
N = 34


class HalfGenerator:
    """Deterministic and batch-independent: answers the first half of the document's words (so a
    rewrite has fewer tokens than its original); '' for 'EMPTY' (refused), raises for 'FAIL'."""

    def generate(self, conversations):
        docs = [c[-1]["content"].rsplit("\n\n", 1)[-1] for c in conversations]
        if any("FAIL" in d for d in docs):
            raise RuntimeError("backend exploded")
        return ["" if "EMPTY" in d else "Rewritten: " + " ".join(d.split()[: len(d.split()) // 2 + 2])
                for d in docs]


class CountingRewriter(DocumentRewriter):
    """A :class:`DocumentRewriter` that records how many documents each call receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.call_sizes: list[int] = []

    def __call__(self, docs, style, budget):
        self.call_sizes.append(docs.height)
        return super().__call__(docs, style, budget)


def write_corpus(path) -> str:
    """34 documents of 6..22 words; d07 and d19 copy d02 (exact_dedup drops them); d05 gets an
    empty rewrite and d11 a generator error."""
    rows = []
    for i in range(N):
        text = " ".join(f"w{i}x{j}" for j in range(6 + (i * 7) % 17))
        if i == 5:
            text = "EMPTY " + text
        if i == 11:
            text = "FAIL " + text
        rows.append({"id": f"d{i:02d}", "text": text})
    rows[7]["text"] = rows[19]["text"] = rows[2]["text"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def recipe(budget: int | None, ratio: float) -> Recipe:
    return Recipe(steps=(step("exact_dedup"), step("rewrite", style="hq", budget=budget),
                         step("mix", rewritten=ratio, seed=3)))


def previous_cache() -> pl.DataFrame:
    """Rewrites of d21, d26 and d30 from an earlier run: settled, so no budget is spent on them."""
    docs = pl.DataFrame({"id": ["d21", "d26", "d30"], "text": ["one two three four five six seven"] * 3})
    rw = DocumentRewriter(HalfGenerator(), min_words=3)
    rw(docs, "hq", None)
    return rw.results


def make_rewriter(cap: int | None) -> CountingRewriter:
    return CountingRewriter(HalfGenerator(), previous=previous_cache(), min_words=3, max_docs_per_run=cap,
                            batch_size=3)


def assert_same_as_in_memory(stats, out, ref):
    assert pl.read_parquet(out / "kept.parquet").equals(ref.kept)
    assert pl.read_parquet(out / "dropped.parquet").equals(ref.dropped)
    for key in ("docs_in", "docs_kept", "docs_dropped", "words_in", "words_kept", "tokens_in", "tokens_kept",
                "docs_rewritten", "dropped_by_reason", "steps"):
        assert stats[key] == ref.stats[key], key


# budget 9 < 31 candidates; a per-run cap of 7 with no step budget; ratios below and above what
# the rewrites reach, so both mix branches (revert rewrites, drop originals) run
@pytest.mark.parametrize("budget,cap", [(9, None), (None, 7)], ids=["budget9", "cap7"])
@pytest.mark.parametrize("ratio", [0.1, 0.6], ids=["revert", "drop"])
def test_rewrite_and_mix_stream_and_equal_the_in_memory_recipe(tmp_path, monkeypatch, budget, cap, ratio):
    src = write_corpus(tmp_path / "in.jsonl")
    docs, _ = read_inputs([src])
    ref_rw = make_rewriter(cap)
    ref = run_recipe(docs, recipe(budget, ratio), rewriter=ref_rw)

    mix_inputs, decided_on = [], []
    real_apply, real_decide = sharded.apply_mix, sharded.mix_decision
    monkeypatch.setattr(sharded, "apply_mix", lambda d, dec: mix_inputs.append(d.height) or real_apply(d, dec))
    monkeypatch.setattr(sharded, "mix_decision", lambda keys, m: decided_on.append(keys.columns) or real_decide(keys, m))

    def in_memory_mix(*args, **kwargs):
        raise AssertionError("the sharded engine ran the in-memory mix")

    monkeypatch.setattr(recipes, "mix_rewritten", in_memory_mix)
    rw = make_rewriter(cap)
    stats = curate_corpus([src], tmp_path / "out", recipe(budget, ratio), shard_docs=SHARD, n_workers=1,
                          rewriter=rw)
    assert_same_as_in_memory(stats, tmp_path / "out", ref)
    # the same documents were generated, and the budget (or cap) was the limit, not the corpus
    assert rw.generated == ref_rw.generated == (budget or cap)
    assert rw.results.sort("id").equals(ref_rw.results.sort("id"))
    info = stats["steps"][1]
    assert info["rewrite_pending"] > 0 and info["rewrite_ok"] == (budget or cap) + 3 - 1  # + cached, - EMPTY
    assert info["rewrite_failed_by_reason"] == ref.stats["steps"][1]["rewrite_failed_by_reason"] != {}
    # streamed: the rewriter and the mix's application see one shard at a time, the decision keys only
    assert len(rw.call_sizes) >= 7 and max(rw.call_sizes) <= SHARD
    assert len(mix_inputs) >= 7 and max(mix_inputs) <= SHARD
    assert decided_on == [list(MIX_KEYS_SCHEMA)]
    mix = stats["steps"][2]
    assert mix["mix_rewritten_share"] == ref.stats["steps"][2]["mix_rewritten_share"]
    assert (mix["mix_docs_original"] < 31 - mix["mix_docs_rewritten"]) == (ratio == 0.6)  # drop branch dropped


def test_main_process_holds_at_most_two_shards_with_rewrite_and_mix(tmp_path, monkeypatch):
    """With workers in other processes, no frame of documents the main process builds, reads or
    writes is larger than two shards while the corpus is eight; the result still equals the
    in-memory recipe. The rewriter's own results (its cache, ``rewritten`` column) are not the
    engine's and are left out."""
    src = write_corpus(tmp_path / "in.jsonl")
    docs, _ = read_inputs([src])
    ref = run_recipe(docs, recipe(9, 0.6), rewriter=make_rewriter(None))
    largest = watch_document_frames(monkeypatch, sharded, join=True, ignore_column="rewritten")
    stats = curate_corpus([src], tmp_path / "out", recipe(9, 0.6), shard_docs=SHARD, n_workers=2,
                          rewriter=make_rewriter(None))
    assert SHARD <= largest[0] <= 2 * SHARD
    monkeypatch.undo()
    assert_same_as_in_memory(stats, tmp_path / "out", ref)
