"""A workdir of word salad for the flow tests that train tiny ladders: prepared train and validation
text (two sources) and curated variants, written where the stages read them."""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl


def word_salad(n_docs: int, words_per_doc: int | tuple[int, int], vocab: int = 60, seed: int = 0) -> list[str]:
    """``n_docs`` documents of words ``w0 .. w<vocab-1>``; ``words_per_doc`` a count or a (low, high) range."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    sizes = (lambda: words_per_doc) if isinstance(words_per_doc, int) else (lambda: rng.randint(*words_per_doc))
    return [" ".join(rng.choice(words) for _ in range(sizes())) for _ in range(n_docs)]


def write_workdir(work: Path, docs: list[str], curated: dict[str, list[str]], n_val: int = 40) -> None:
    """``docs`` but the last ``n_val`` as the prepared train split, those as validation (sources a, b in
    turn), and each ``curated`` variant's kept documents."""
    prepared = work / "data" / "prepared"
    (prepared / "train").mkdir(parents=True)
    pl.DataFrame({"text": docs[:-n_val]}).write_parquet(prepared / "train" / "shard-00000.parquet")
    pl.DataFrame({"text": docs[-n_val:], "source": ["a", "b"] * (n_val // 2)}).write_parquet(prepared / "val.parquet")
    for variant, kept in curated.items():
        (work / "data" / "curated" / variant).mkdir(parents=True)
        pl.DataFrame({"text": kept}).write_parquet(work / "data" / "curated" / variant / "kept.parquet")
