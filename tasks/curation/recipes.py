"""Curation recipes: ordered interventions that turn the prepared train split into one corpus variant.

A :class:`Recipe` is a tuple of :class:`Step` s, each exactly one of

* ``exact_dedup: {}`` — drop exact duplicates (``tasks.curation.dedup.exact_duplicates``);
* ``minhash: {threshold: 0.8, ...}`` — MinHash-LSH near-duplicate removal (``MinHashConfig``);
* any filter in ``tasks.curation.filters.FILTERS`` (``gopher_quality: {}``, ``c4_quality: {...}``, ...);
* a crawl filter in ``tasks.curation.crawl.CRAWL_FILTERS`` (``language_id: {languages: [en]}``,
  ``pii: {}``, ``url_filter: {blocklist_file: ...}``);
* ``email_body: {keep_subject: false, ...}`` — e-mail headers, quoted replies, forwarded blocks,
  signatures and list footers stripped (:mod:`tasks.curation.mail`; put it before the filters);
* ``rewrite: {style: hq, budget: 200}`` — LLM rewrites (:mod:`tasks.curation.rewrite`);
* ``mix: {rewritten: 0.67}`` — keep rewritten and original text at a token ratio.

QualityPajama (ICLR 2026) compares 23 such variants by their whole scaling
trajectories. In YAML (``params/curation.yaml``)::

    variants:
      dedup_gopher: {steps: [{exact_dedup: {}}, {gopher_quality: {}}, {gopher_repetition: {}}]}

Steps are parsed with :func:`tasks.common.config.from_mapping`, so an unknown step
or setting raises ``ConfigError`` naming the file and the dotted key
(``curation.variants.dedup_gopher.steps[1].gopher_qualty``).

Every removed document lands in ``dropped`` with a reason (``<filter>.<rule>``,
``exact_dedup.duplicate``, ``minhash.near_duplicate``, ``mix.over_ratio``) and, for
dedup, the id of the kept representative; ``docs_in == docs_kept + docs_dropped``
always holds and is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from tasks.common.config import from_mapping, require
from tasks.curation.crawl import CRAWL_FILTERS
from tasks.curation.dedup import DedupIndex, MinHashConfig, exact_duplicates, minhash_duplicates
from tasks.curation.decontam import DecontaminationConfig, ValDecontaminator
from tasks.curation.filters import FILTERS, FilterResult
from tasks.curation.mail import EMAIL_STEPS
from tasks.curation.rewrite import STYLES, GeneratorConfig
from tasks.curation.text import TokenCount, check_token_count, counter_name, whitespace_words

#: Columns of a kept frame: the document columns plus ``rewrite`` (the style, or null for original text).
KEPT_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "text": pl.Utf8, "source": pl.Utf8, "url": pl.Utf8, "title": pl.Utf8, "rewrite": pl.Utf8,
}
#: Columns of a dropped frame.
DROPPED_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "reason": pl.Utf8, "duplicate_of": pl.Utf8, "source": pl.Utf8, "text": pl.Utf8,
}
_REWRITE_COL = "_rewrite_text"

# ---------------------------------------------------------------- step configs


@dataclass(frozen=True, kw_only=True)
class ExactDedupStep:
    """Exact-duplicate removal; the first occurrence (input order) is kept. No settings."""


@dataclass(frozen=True, kw_only=True)
class RewriteStep:
    """Rewrite up to ``budget`` documents (None = all) into ``style``; text is replaced only where a mix
    step (or the end of the recipe) uses the rewrite."""

    style: str = "hq"
    budget: int | None = None

    def __post_init__(self) -> None:
        require(self.style in STYLES, "style", f"unknown style {self.style!r}; choose from {list(STYLES)}")
        require(self.budget is None or self.budget >= 0, "budget", "must be >= 0 or null (all)")


@dataclass(frozen=True, kw_only=True)
class MixStep:
    """Keep rewritten and original text so that rewritten tokens are ``rewritten`` of the total.

    QualityPajama mixes at 100/0, 67/33 and 33/67 (``rewritten: 1.0, 0.67, 0.33``).
    Each source document contributes at most one version. Too much rewritten text:
    some documents revert to their original; too little: original-only documents
    are dropped (``mix.over_ratio``). Which ones is fixed by ``hash(seed, id)``.
    """

    rewritten: float
    seed: int = 0

    def __post_init__(self) -> None:
        require(0.0 <= self.rewritten <= 1.0, "rewritten", "must be in [0, 1]")


_GLOBAL_KINDS = ("exact_dedup", "minhash", "rewrite", "mix")


def _step_fields() -> list[tuple[str, Any, Any]]:
    kinds: list[tuple[str, type]] = [("exact_dedup", ExactDedupStep), ("minhash", MinHashConfig)]
    kinds += [(name, cfg_cls) for name, (cfg_cls, _fn) in FILTERS.items()]
    kinds += [(name, cfg_cls) for name, (cfg_cls, _fn) in CRAWL_FILTERS.items()]
    kinds += [(name, cfg_cls) for name, (cfg_cls, _fn) in EMAIL_STEPS.items()]
    kinds += [("rewrite", RewriteStep), ("mix", MixStep)]
    # Annotated as the bare config class (default None) rather than ``cls | None``: from_mapping
    # then reports a bad setting by its own key instead of "expected X or NoneType".
    return [(name, cls, field(default=None)) for name, cls in kinds]


def _step_post_init(self: Any) -> None:
    given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
    require(len(given) == 1, "step",
            f"give exactly one intervention per step (a mapping, {{}} for defaults); got {given or 'none'}")


def _step_kind(self: Any) -> str:
    return next(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)


def _step_settings(self: Any) -> Any:
    return getattr(self, _step_kind(self))


def _step_is_global(self: Any) -> bool:
    return _step_kind(self) in _GLOBAL_KINDS


# One optional field per intervention, generated from FILTERS so a new filter is a new step
# kind without touching this file; from_mapping then rejects unknown kinds and settings.
Step = dataclasses.make_dataclass(
    "Step",
    _step_fields(),
    frozen=True,
    kw_only=True,
    namespace={
        "__doc__": "One recipe step: exactly one field set, e.g. ``Step(minhash=MinHashConfig(threshold=0.8))``.",
        "__post_init__": _step_post_init,
        "kind": property(_step_kind, doc="The intervention's name (the one field that is set)."),
        "settings": property(_step_settings, doc="The intervention's config."),
        "is_global": property(_step_is_global, doc="True for steps that need the whole corpus at once."),
    },
)
Step.__module__ = __name__  # so pickling (process pools) finds it; make_dataclass(module=) is 3.12+


def step(kind: str, **settings: Any) -> Any:
    """``step("minhash", threshold=0.8)`` — a :class:`Step` from a kind name and its settings."""
    kinds = {f.name: f for f in dataclasses.fields(Step)}
    require(kind in kinds, "step", f"unknown step {kind!r}; known: {sorted(kinds)}")
    return Step(**{kind: kinds[kind].type(**settings)})


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """An ordered list of interventions (empty = the raw corpus)."""

    steps: tuple[Step, ...] = ()  # type: ignore[valid-type]
    description: str = ""

    def __post_init__(self) -> None:
        seen_rewrite = False
        for i, s in enumerate(self.steps):
            if s.kind == "rewrite":
                require(not seen_rewrite, f"steps[{i}]", "one rewrite step per recipe")
                seen_rewrite = True
            if s.kind == "mix":
                require(seen_rewrite, f"steps[{i}]", "a mix step needs a rewrite step before it")

    @property
    def needs_rewriter(self) -> bool:
        return any(s.kind == "rewrite" for s in self.steps)


@dataclass(frozen=True, kw_only=True)
class DedupIndexConfig:
    """``curation.index``: a persisted dedup index of an earlier corpus (:class:`DedupIndex`).

    ``path``: its folder. The recipe's ``exact_dedup`` and ``minhash`` steps then also drop the
    documents that duplicate an indexed one, ``duplicate_of`` naming the indexed id (indexed
    documents always win). null = no index.
    ``update``: after the run, add this corpus's kept documents to the index (created if the
    folder does not exist yet), so the next corpus is deduplicated against both. ``scalelab
    curate`` only: the pipeline builds several variants of one corpus, so it reads an index
    but does not extend one.
    """

    path: str | None = None
    update: bool = False

    def __post_init__(self) -> None:
        require(not (self.update and self.path is None), "update", "needs index.path (the folder to extend)")


@dataclass(frozen=True, kw_only=True)
class CurationConfig:
    """The ``curation`` section of params/curation.yaml.

    ``variants`` defines every recipe; ``active`` names the ones this preset builds
    (presets change only the list). ``rewrite`` configures the generator for rewrite
    steps; ``shard_docs``/``n_workers`` size the sharded engine; ``index`` names a persisted
    dedup index of an earlier corpus (:class:`DedupIndexConfig`). ``decontamination`` removes,
    from every variant after its recipe, the documents that largely repeat validation text
    (:mod:`tasks.curation.decontam`). ``token_count`` (``words`` or ``tokenizer:<path>``,
    :func:`tasks.curation.crawl.token_counter`) counts the ``tokens_in``/``tokens_kept`` of every
    variant's stats and the mix step's token ratios; ``stats.json`` names it.
    """

    active: tuple[str, ...]
    variants: dict[str, Recipe]
    rewrite: GeneratorConfig = field(default_factory=GeneratorConfig)
    decontamination: DecontaminationConfig = field(default_factory=DecontaminationConfig)
    shard_docs: int = 20_000
    n_workers: int = 2
    index: DedupIndexConfig = field(default_factory=DedupIndexConfig)
    token_count: str = "words"

    def __post_init__(self) -> None:
        problem = check_token_count(self.token_count)
        require(problem is None, "token_count", problem or "")
        require(len(self.active) > 0, "active", "name at least one variant")
        missing = [a for a in self.active if a not in self.variants]
        require(not missing, "active", f"unknown variant(s) {missing}; defined: {sorted(self.variants)}")
        require(len(set(self.active)) == len(self.active), "active", "lists a variant twice")
        require(self.shard_docs > 0, "shard_docs", "must be positive")
        require(self.n_workers > 0, "n_workers", "must be positive")

    def recipe(self, name: str) -> Recipe:
        require(name in self.variants, "variant", f"unknown variant {name!r}; defined: {sorted(self.variants)}")
        return self.variants[name]


# ---------------------------------------------------------------- applying steps


@dataclass(frozen=True)
class CurationResult:
    """``kept``: :data:`KEPT_SCHEMA`; ``dropped``: :data:`DROPPED_SCHEMA`; ``stats``: see :func:`run_recipe`."""

    kept: pl.DataFrame
    dropped: pl.DataFrame
    stats: dict


def _as_working(docs: pl.DataFrame) -> pl.DataFrame:
    missing = [c for c in ("id", "text") if c not in docs.columns]
    require(not missing, "docs", f"missing column(s) {missing}")
    cols = []
    for name, dtype in KEPT_SCHEMA.items():
        cols.append(pl.col(name).cast(dtype) if name in docs.columns else pl.lit(None, dtype=dtype).alias(name))
    out = docs.select(cols)
    if _REWRITE_COL in docs.columns:
        out = out.with_columns(docs[_REWRITE_COL].cast(pl.Utf8))
    else:
        out = out.with_columns(pl.lit(None, dtype=pl.Utf8).alias(_REWRITE_COL))
    return out


def _dropped(frame: pl.DataFrame, reason: pl.Series | str, duplicate_of: pl.Series | None = None) -> pl.DataFrame:
    n = frame.height
    reasons = reason if isinstance(reason, pl.Series) else pl.Series([reason] * n, dtype=pl.Utf8)
    dup = duplicate_of if duplicate_of is not None else pl.Series([None] * n, dtype=pl.Utf8)
    return pl.DataFrame(
        {"id": frame["id"], "reason": reasons, "duplicate_of": dup, "source": frame["source"], "text": frame["text"]},
        schema=DROPPED_SCHEMA,
    )


def _hash_order(ids: pl.Series, seed: int) -> np.ndarray:
    salt = f"mix:{seed}:".encode()
    keys = [hashlib.blake2b(salt + s.encode(), digest_size=8).digest() for s in ids.to_list()]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


#: Columns of :func:`mix_keys`: all that :func:`mix_decision` reads of a document.
MIX_KEYS_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "has_rewrite": pl.Boolean, "tokens": pl.Int64, "rewrite_tokens": pl.Int64,
}
#: Columns of :func:`mix_decision`'s decision: which text each document keeps, or whether it goes.
MIX_DECISION_SCHEMA: dict[str, pl.DataType] = {"id": pl.Utf8, "use_rewrite": pl.Boolean, "drop": pl.Boolean}


def mix_keys(docs: pl.DataFrame, *, token_count: TokenCount = whitespace_words) -> pl.DataFrame:
    """The per-document keys a mix decides on (:data:`MIX_KEYS_SCHEMA`): id, whether the working
    frame ``docs`` carries a rewrite (``_rewrite_text``), and the token counts of the original and
    of the rewrite. Keys of shards concatenate to the keys of the whole corpus."""
    return pl.DataFrame({
        "id": docs["id"], "has_rewrite": docs[_REWRITE_COL].is_not_null(),
        "tokens": token_count(docs["text"]).cast(pl.Int64),
        # a missing rewrite's count is never read; 0 keeps a token_count that yields null for null harmless
        "rewrite_tokens": token_count(docs[_REWRITE_COL]).cast(pl.Int64).fill_null(0),
    }, schema=MIX_KEYS_SCHEMA)


def mix_decision(keys: pl.DataFrame, mix: MixStep) -> tuple[pl.DataFrame, dict]:
    """Choose per document the rewritten or original text so rewritten tokens ≈ ``mix.rewritten`` of all.

    ``keys``: :func:`mix_keys` of every document, in corpus order. Start with every available
    rewrite used; if the rewritten share is above the target, walk the documents in
    ``hash(seed, id)`` order and revert each to its original when that brings the share closer;
    if below, drop original-only documents the same way. The share ends within about one
    document's tokens of the target. Returns ``(decision, stats)``: the decision
    (:data:`MIX_DECISION_SCHEMA`, a row per key, applied by :func:`apply_mix`) and
    ``stats["mix_rewritten_share"]``, the share reached.
    """
    target = mix.rewritten
    has = keys["has_rewrite"].to_numpy().astype(bool)
    orig = keys["tokens"].to_numpy().astype(np.int64)
    rw = keys["rewrite_tokens"].to_numpy().astype(np.int64)
    use_rw = has.copy()
    drop = np.zeros(len(has), dtype=bool)
    if target > 0 and not has.any() and keys.height:
        raise ValueError(f"mix: rewritten share {target} asked, but no document has a successful rewrite")
    R, O = int(rw[has].sum()), int(orig[~has].sum())

    def share(r: int, o: int) -> float:
        return r / (r + o) if r + o else 0.0

    order = _hash_order(keys["id"], mix.seed)
    if share(R, O) > target:
        for i in order:
            if not use_rw[i]:
                continue
            r2, o2 = R - rw[i], O + orig[i]
            if abs(share(r2, o2) - target) < abs(share(R, O) - target):  # else try a smaller one
                R, O, use_rw[i] = r2, o2, False
    elif share(R, O) < target:
        for i in order:
            if use_rw[i] or drop[i]:
                continue
            o2 = O - orig[i]
            if abs(share(R, o2) - target) < abs(share(R, O) - target):
                O, drop[i] = o2, True
    decision = pl.DataFrame({"id": keys["id"], "use_rewrite": use_rw, "drop": drop}, schema=MIX_DECISION_SCHEMA)
    stats = {"mix_rewritten_share": share(R, O), "mix_target": target,
             "mix_docs_rewritten": int(use_rw.sum()), "mix_docs_original": int((~use_rw & ~drop).sum())}
    return decision, stats


def apply_mix(docs: pl.DataFrame, decision: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Apply a :func:`mix_decision` to a working frame (the whole corpus, or one shard of it:
    ``decision`` may hold rows of other documents too); returns ``(kept, dropped)``, the dropped
    ones as ``mix.over_ratio``. Every document of ``docs`` must have a decision row."""
    d = docs.select("id").join(decision, on="id", how="left", maintain_order="left")
    if d["use_rewrite"].null_count():
        raise ValueError(f"mix: no decision for {d['use_rewrite'].null_count()} document(s)")
    use, drop = d["use_rewrite"], d["drop"]
    out = docs.with_columns(
        pl.when(use).then(pl.col(_REWRITE_COL)).otherwise(pl.col("text")).alias("text"),
        pl.when(use).then(pl.col("rewrite")).otherwise(pl.lit(None, dtype=pl.Utf8)).alias("rewrite"),
        pl.lit(None, dtype=pl.Utf8).alias(_REWRITE_COL),  # consumed: finalize must not re-apply it
    )
    return out.filter(~drop), _dropped(out.filter(drop), "mix.over_ratio")


def mix_rewritten(
    docs: pl.DataFrame, mix: MixStep, *, token_count: TokenCount = whitespace_words
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """:func:`mix_decision` on the :func:`mix_keys` of ``docs`` (a working frame carrying the
    rewrite in ``_rewrite_text``, null = none), applied by :func:`apply_mix`. Returns ``(kept,
    dropped, stats)`` with ``stats["mix_rewritten_share"]`` the share reached. The sharded engine
    runs the same three pieces with keys per shard and the decision made once on all keys."""
    decision, stats = mix_decision(mix_keys(docs, token_count=token_count), mix)
    kept, dropped = apply_mix(docs, decision)
    return kept, dropped, stats


class FilterCache:
    """Decisions of heuristic filters, remembered by (filter, settings, text) across recipes.

    A filter is a pure function of one document's text, so variants that share a filter
    (``gopher`` and ``dedup_gopher``; ``c4`` and ``dedup_gopher_c4`` in ``full``) need each
    distinct text judged once per setting. Pass one cache to every :func:`run_recipe` of a run.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[str, Any], pl.DataFrame] = {}

    def apply(self, kind: str, cfg: Any, texts: pl.Series):
        """``FILTERS[kind]`` on ``texts``; only texts this cache has not judged are computed."""
        _cfg_cls, fn = FILTERS[kind]
        key = (kind, cfg)
        frame = pl.DataFrame({"text": texts.cast(pl.Utf8)})
        known = self._seen.get(key)
        todo = frame.unique("text", maintain_order=True)
        if known is not None:
            todo = todo.join(known.select("text"), on="text", how="anti", nulls_equal=True)
        if todo.height:
            res = fn(todo["text"], cfg)
            new = todo.with_columns(res.reasons.cast(pl.Utf8).alias("reason"),
                                    (res.texts.cast(pl.Utf8) if res.texts is not None
                                     else pl.Series([None] * todo.height, dtype=pl.Utf8)).alias("edited"),
                                    pl.lit(res.texts is not None).alias("edits"))
            known = new if known is None else pl.concat([known, new])
            self._seen[key] = known
        out = frame.join(known, on="text", how="left", maintain_order="left", nulls_equal=True)
        return FilterResult(reasons=out["reason"], texts=out["edited"] if known["edits"].any() else None)


def apply_step(
    docs: pl.DataFrame,
    s: Any,
    *,
    rewriter: Callable[[pl.DataFrame, str, int | None], pl.DataFrame] | None = None,
    token_count: TokenCount = whitespace_words,
    filter_cache: FilterCache | None = None,
    index: DedupIndex | None = None,
    executor: Any = None,
    n_shards: int = 1,
) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Apply one :class:`Step` to a working frame; returns ``(kept, dropped, step_stats)``.

    Filter steps act per document (safe to run on shards); ``exact_dedup``,
    ``minhash``, ``rewrite`` and ``mix`` need the whole corpus (``s.is_global``).
    ``index`` (an earlier corpus, :class:`~tasks.curation.dedup.DedupIndex`): the dedup steps
    also drop documents duplicating an indexed one, ``duplicate_of`` naming the indexed id, and
    count them in ``duplicates_of_index``. ``executor``/``n_shards``: MinHash signatures are
    computed in ``n_shards`` pieces through ``executor`` (any ``submit``), as in
    :func:`~tasks.curation.dedup.minhash_duplicates`; the result does not depend on them.
    """
    docs = _as_working(docs)
    kind, cfg = s.kind, s.settings
    info: dict[str, Any] = {"step": kind}
    if kind in ("exact_dedup", "minhash"):
        if index is not None and not len(index):
            index = None
        if kind == "exact_dedup":
            dup = exact_duplicates(docs["text"], docs["id"], index=index)
            reason = "exact_dedup.duplicate"
        else:
            if index is not None:
                index.minhash_config_for([cfg])  # refuses an index without signatures, or of other settings
            dup = minhash_duplicates(docs["text"], docs["id"], cfg, index=index, executor=executor,
                                     n_shards=n_shards)
            reason = "minhash.near_duplicate"
        is_dup = dup.is_not_null()
        if index is not None:
            info["duplicates_of_index"] = int(dup.is_in(index.ids.implode()).sum())
        dropped = _dropped(docs.filter(is_dup), reason, dup.filter(is_dup).cast(pl.Utf8))
        kept = docs.filter(~is_dup)
    elif kind == "rewrite":
        if rewriter is None:
            raise ValueError("this recipe has a rewrite step: pass rewriter= (e.g. rewrite.DocumentRewriter)")
        res = rewriter(docs.select("id", "text"), cfg.style, cfg.budget)
        ok = res.filter(pl.col("rewritten")).select("id", pl.col("text").alias("_new"))
        kept = (
            docs.join(ok, on="id", how="left", maintain_order="left")
            .with_columns(
                pl.coalesce("_new", _REWRITE_COL).alias(_REWRITE_COL),
                pl.when(pl.col("_new").is_not_null()).then(pl.lit(cfg.style)).otherwise(pl.col("rewrite")).alias("rewrite"),
            )
            .drop("_new")
        )
        dropped = _dropped(docs.head(0), "")
        failed = res.filter(~pl.col("rewritten"))
        # Documents still without a successful rewrite (budget or per-run cap spent, or failed):
        # a resumable runner must not mark this step done while this is above 0.
        info.update(rewrite_attempted=res.height, rewrite_ok=ok.height, rewrite_pending=docs.height - ok.height,
                    rewrite_failed_by_reason=dict(sorted((r, int(c)) for r, c in failed.group_by("error").len().iter_rows())))
    elif kind == "mix":
        kept, dropped, mix_stats = mix_rewritten(docs, cfg, token_count=token_count)
        info.update(mix_stats)
    else:
        if kind in CRAWL_FILTERS:  # they read the frame (url as well as text), so no text-keyed cache
            result = CRAWL_FILTERS[kind][1](docs, cfg)
        elif kind in EMAIL_STEPS:  # not cached: the cache keeps decisions, not the step's line counters
            result = EMAIL_STEPS[kind][1](docs["text"], cfg)
        else:
            _cfg_cls, fn = FILTERS[kind]
            result = filter_cache.apply(kind, cfg, docs["text"]) if filter_cache is not None else fn(docs["text"], cfg)
        info.update(result.stats)
        reasons = result.reasons.cast(pl.Utf8)
        edited = docs
        if result.texts is not None:
            edited = docs.with_columns(result.texts.cast(pl.Utf8).alias("text"))
            # An edit that empties a kept document (C4 line removal) leaves nothing to train on.
            emptied = reasons.is_null() & (edited["text"].fill_null("").str.strip_chars() == "")
            reasons = pl.select(
                pl.when(emptied).then(pl.lit(f"{kind}.empty_after_edit")).otherwise(reasons).alias("r")
            ).to_series()
        drop = reasons.is_not_null()
        dropped = _dropped(docs.filter(drop), reasons.filter(drop))  # the original text, as it came in
        kept = edited.filter(~drop)
    info.update(docs_in=docs.height, docs_out=kept.height)
    return kept, dropped, info


def finalize(kept: pl.DataFrame) -> pl.DataFrame:
    """A working frame as :data:`KEPT_SCHEMA`: rewrites not consumed by a mix step replace the text."""
    kept = _as_working(kept)
    return kept.with_columns(pl.coalesce(_REWRITE_COL, "text").alias("text")).select(list(KEPT_SCHEMA))


def curation_stats(docs_in: pl.DataFrame, kept: pl.DataFrame, dropped: pl.DataFrame,
                   *, token_count: TokenCount = whitespace_words, steps: list[dict] | None = None) -> dict:
    """Counts that reconcile: ``docs_in == docs_kept + docs_dropped`` (raises ``AssertionError`` if not)."""
    by_reason = dict(sorted((r, int(c)) for r, c in dropped.group_by("reason").len().iter_rows()))
    rewritten = int(kept["rewrite"].is_not_null().sum()) if "rewrite" in kept.columns else 0
    return stats_from_counts(text_counts(docs_in["text"], token_count), text_counts(kept["text"], token_count),
                             dropped_by_reason=by_reason, docs_rewritten=rewritten, steps=steps,
                             token_count=counter_name(token_count))


def text_counts(texts: pl.Series, token_count: TokenCount = whitespace_words) -> dict[str, int]:
    """``docs``, whitespace ``words`` and ``tokens`` of some texts; counts of parts add up."""
    return {"docs": len(texts), "words": int(whitespace_words(texts).sum() or 0),
            "tokens": int(token_count(texts).sum() or 0)}


def stats_from_counts(counts_in: dict[str, int], counts_kept: dict[str, int], *, dropped_by_reason: dict[str, int],
                      docs_rewritten: int, steps: list[dict] | None = None, token_count: str = "words") -> dict:
    """:func:`curation_stats` from :func:`text_counts` of the input and the kept documents (summed
    over shards by a caller that never holds the corpus); raises ``AssertionError`` when the
    documents in are not those kept plus those dropped. ``token_count`` names what counted the
    ``tokens_*`` (:func:`~tasks.curation.text.counter_name`)."""
    n_in, n_kept, n_drop = counts_in["docs"], counts_kept["docs"], sum(dropped_by_reason.values())
    if n_in != n_kept + n_drop:
        raise AssertionError(f"curation lost documents: {n_in} in != {n_kept} kept + {n_drop} dropped")
    return {
        "docs_in": n_in,
        "docs_kept": n_kept,
        "docs_dropped": n_drop,
        "words_in": counts_in["words"],
        "words_kept": counts_kept["words"],
        "tokens_in": counts_in["tokens"],
        "tokens_kept": counts_kept["tokens"],
        "token_count": token_count,
        "docs_rewritten": docs_rewritten,
        "dropped_by_reason": dropped_by_reason,
        "steps": steps or [],
    }


def decontaminate_part(kept: pl.DataFrame, deco: ValDecontaminator
                       ) -> tuple[pl.DataFrame, pl.DataFrame, np.ndarray, np.ndarray]:
    """Split finished documents (a variant, or one shard of it) into kept and dropped as
    ``val_contamination``, with the validation n-grams found in them before and after
    (:meth:`~tasks.curation.decontam.ValDecontaminator.val_found`; parts combine by ``|``)."""
    reasons = deco(kept["text"]).reasons
    drop = reasons.is_not_null()
    out = kept.filter(~drop)
    return (out, _dropped(kept.filter(drop), reasons.filter(drop)),
            deco.val_found(kept["text"]), deco.val_found(out["text"]))


def decontamination_info(deco: ValDecontaminator, docs_in: int, docs_out: int, found_before: np.ndarray,
                         found_after: np.ndarray) -> dict:
    """The ``val_decontamination`` step's stats from counts and found-masks of the whole variant."""
    return {
        "kind": "val_decontamination", "docs_in": docs_in, "docs_out": docs_out,
        "ngram": deco.cfg.ngram, "threshold": deco.cfg.threshold,
        "val_ngram_share_before": deco.share_of(found_before),
        "val_ngram_share_after": deco.share_of(found_after),
    }


def decontaminate_step(kept: pl.DataFrame, deco: ValDecontaminator) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """Split a finished variant into (kept, dropped as ``val_contamination``, step info)."""
    out, dropped, before, after = decontaminate_part(kept, deco)
    return out, dropped, decontamination_info(deco, kept.height, out.height, before, after)


def run_recipe(
    docs: pl.DataFrame,
    recipe: Recipe,
    *,
    rewriter: Callable[[pl.DataFrame, str, int | None], pl.DataFrame] | None = None,
    token_count: TokenCount = whitespace_words,
    filter_cache: FilterCache | None = None,
    decontaminate: ValDecontaminator | None = None,
    index: DedupIndex | None = None,
) -> CurationResult:
    """Apply ``recipe`` to ``docs`` (columns ``id``, ``text``; ``source``/``url``/``title`` optional).

    Returns kept documents (:data:`KEPT_SCHEMA`), dropped ones (:data:`DROPPED_SCHEMA`)
    and stats: ``docs_in/kept/dropped``, ``words_in/kept`` (whitespace words),
    ``tokens_in/kept`` (by ``token_count``; default whitespace words),
    ``dropped_by_reason`` and per-step ``steps`` (docs in/out, rewrite and mix details).
    Ids must be unique. ``filter_cache`` (a :class:`FilterCache` shared by the recipes of one
    run) reuses filter decisions already made on the same texts; results are the same.
    ``decontaminate`` (built from the validation split) runs last, on the recipe's final texts
    (a rewrite can copy validation text too), as a step ``val_decontamination`` that drops with
    reason ``val_contamination`` and records the validation n-gram share found in the variant's
    training text before and after it. ``index``: see :func:`apply_step`.

    >>> res = run_recipe(prepared.train, cfg.recipe("dedup_gopher"))
    """
    require(docs["id"].n_unique() == docs.height, "docs.id", "ids must be unique")
    work = _as_working(docs)
    dropped_parts = []
    steps = []
    for s in recipe.steps:
        work, dropped, info = apply_step(work, s, rewriter=rewriter, token_count=token_count,
                                         filter_cache=filter_cache, index=index)
        dropped_parts.append(dropped)
        steps.append(info)
    kept = finalize(work)
    if decontaminate is not None:
        kept, dropped, info = decontaminate_step(kept, decontaminate)
        dropped_parts.append(dropped)
        steps.append(info)
    dropped = pl.concat(dropped_parts) if dropped_parts else pl.DataFrame(schema=DROPPED_SCHEMA)
    stats = curation_stats(docs, kept, dropped, token_count=token_count, steps=steps)
    return CurationResult(kept=kept, dropped=dropped, stats=stats)


def step_kinds() -> list[str]:
    """Every step name a recipe accepts."""
    return [f.name for f in dataclasses.fields(Step)]


def recipe_from_mapping(data: Mapping[str, Any], *, source: str | None = None, prefix: str = "recipe") -> Recipe:
    """Parse one recipe mapping (``{steps: [...]}``) with file/key-naming errors."""
    return from_mapping(Recipe, data, source=source, prefix=prefix)
