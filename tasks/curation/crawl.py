"""Filters a web crawl needs before the heuristic ones: language identification, PII normalisation,
URL block lists, and a BPE token count for the stats.

Each filter is a recipe step (:data:`CRAWL_FILTERS`): it takes the working frame (so it can read
``url`` as well as ``text``) and its config, and returns a :class:`~tasks.curation.filters.FilterResult`
whose ``reasons`` name the rule a dropped document failed and whose ``stats`` holds flat integer
counters (summed across shards by the sharded engine)::

    crawl_clean: {steps: [{url_filter: {blocklist_file: params/url_blocklist.txt}},
                          {language_id: {languages: [en], min_score: 0.65}}, {pii: {}}, ...]}

* ``language_id`` — py3langid (a numpy port of langid.py, Lui & Baldwin 2012: a multinomial naive
  Bayes over byte n-grams, 97 languages); the model (``data/model.npz.xz``, 1.5 MB) ships inside
  the wheel, so it loads with no network (checked under ``unshare -n``). Measured on one core:
  ~5,400 documents/s of 1,800 characters; ~6,900/s over the 70,338 embedded documents (mean 353
  characters). Its probabilities are low on very short texts: at ``min_score: 0.65`` it keeps
  98-100% of the embedded news, BBC and parliament speeches (median 76-435 words) but 58% of the
  health tweets (median 11 words, 95% identified as English); lower ``min_score`` for such text. Reasons ``language_id.other_language`` (the top
  language is not kept) and ``language_id.low_score`` (kept language, normalised probability
  below ``min_score``); counters ``language_id.<lang>`` per top language.
* ``pii`` — e-mail addresses, IPv4/IPv6 addresses and phone numbers replaced by placeholders
  (``<EMAIL_ADDRESS>``, ``<IP_ADDRESS>``, ``<PHONE_NUMBER>``; the tags are dolma's PII kinds in
  angle brackets, configurable); drops nothing; counters ``pii.email``, ``pii.ip``, ``pii.phone``.
  Like datatrove's ``PIIFormatter``, IP addresses are validated (octets <= 255, IPv6 parsed by
  :mod:`ipaddress`) and private/loopback addresses can be kept (``keep_private_ips``).
* ``url_filter`` — block lists of domains (the host or any parent domain) and of words (a token of
  the URL split on non-alphanumerics, as datatrove's ``URLFilter`` banned words), from the config
  and from ``blocklist_file``. Documents with no ``url`` pass; when no document has one the step
  says so once (a log line and the counter ``url_filter.no_url_column``).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import polars as pl

from tasks.common.config import require
from tasks.common.params import PACKAGED_ROOT
from tasks.curation.filters import FilterResult
from tasks.curation.text import TokenCount, check_token_count, whitespace_words

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LANGID_INSTALL = "pip install py3langid==0.4.0"


# ---------------------------------------------------------------- language identification


@dataclass(frozen=True, kw_only=True)
class LanguageIdConfig:
    """Keep documents whose most probable language is in ``languages`` with probability >= ``min_score``.

    ``min_score`` is py3langid's normalised probability (0.65 is datatrove's ``LanguageFilter``
    default for its fastText model). ``max_chars`` classifies only a document's first characters
    (the byte n-gram counts saturate long before; None = the whole text).
    """

    languages: tuple[str, ...] = ("en",)
    min_score: float = 0.65
    max_chars: int | None = 4000

    def __post_init__(self) -> None:
        require(len(self.languages) > 0, "languages", "name at least one ISO 639-1 code to keep")
        unknown = sorted(set(self.languages) - set(_langid_languages()))
        require(not unknown, "languages", f"py3langid does not know {unknown}; it knows {sorted(_langid_languages())}")
        require(0.0 <= self.min_score <= 1.0, "min_score", "must be in [0, 1]")
        require(self.max_chars is None or self.max_chars > 0, "max_chars", "must be positive or null (whole text)")


@functools.cache
def _langid_model():
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise RuntimeError(f"language_id needs py3langid: {LANGID_INSTALL}") from None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


@functools.cache
def _langid_languages() -> tuple[str, ...]:
    return tuple(_langid_model().nb_classes)


def language_id(docs: pl.DataFrame, cfg: LanguageIdConfig = LanguageIdConfig()) -> FilterResult:
    """Language of each ``docs["text"]`` by py3langid; drop other languages and uncertain scores.

    >>> language_id(pl.DataFrame({"text": ["The cat sat on the mat and looked at the dog."]})).reasons.to_list()
    [None]
    """
    model = _langid_model()
    keep = set(cfg.languages)
    reasons: list[str | None] = []
    counts: dict[str, int] = {}
    for text in docs["text"].fill_null("").to_list():
        lang, score = model.classify(text[: cfg.max_chars] if cfg.max_chars else text)
        counts[f"language_id.{lang}"] = counts.get(f"language_id.{lang}", 0) + 1
        if lang not in keep:
            reasons.append("language_id.other_language")
        elif score < cfg.min_score:
            reasons.append("language_id.low_score")
        else:
            reasons.append(None)
    return FilterResult(reasons=pl.Series(reasons, dtype=pl.Utf8), stats=dict(sorted(counts.items())))


# ---------------------------------------------------------------- PII


@dataclass(frozen=True, kw_only=True)
class PiiConfig:
    """Which PII kinds to replace, and by what. A kind whose placeholder is null is left alone."""

    email: str | None = "<EMAIL_ADDRESS>"
    ip: str | None = "<IP_ADDRESS>"
    phone: str | None = "<PHONE_NUMBER>"
    keep_private_ips: bool = True

    def __post_init__(self) -> None:
        for name in ("email", "ip", "phone"):
            v = getattr(self, name)
            require(v is None or v != "", name, "give a placeholder or null (leave this kind alone)")


_EMAIL = re.compile(
    r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}\b"
)
# Candidates only; each is validated by ipaddress before it is replaced.
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.]*\d)")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Fa-f:])")
# North American numbers ((555) 123-4567, 555-123-4567, +1 555 123 4567) and international ones
# written with a leading + and 7-15 digits in groups; bare digit runs (years, ids) are not phones.
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"(?:\+?1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-])\d{3}[ .-]\d{4}"
    r"|\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}"
    r")(?!\w)"
)


def _ip_ok(candidate: str, keep_private: bool) -> bool:
    try:
        addr = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    if keep_private and (addr.is_private or addr.is_loopback or addr.is_unspecified):
        return False
    return True


def _international_digits_ok(match: str) -> bool:
    n = sum(c.isdigit() for c in match)
    return 7 <= n <= 15


def pii_normalize(docs: pl.DataFrame, cfg: PiiConfig = PiiConfig()) -> FilterResult:
    """Replace e-mail addresses, IP addresses and phone numbers in ``docs["text"]`` by placeholders.

    Order: e-mails, then IPs, then phones (so an address's digits are not read as a phone number).
    Drops nothing; ``texts`` is the edited text and ``stats`` counts replacements per kind.

    >>> pii_normalize(pl.DataFrame({"text": ["mail a.b@example.org or call (555) 123-4567"]})).texts.to_list()
    ['mail <EMAIL_ADDRESS> or call <PHONE_NUMBER>']
    """
    counts = {"pii.email": 0, "pii.ip": 0, "pii.phone": 0}

    def sub_ip(m: re.Match) -> str:
        if _ip_ok(m.group(0), cfg.keep_private_ips):
            counts["pii.ip"] += 1
            return cfg.ip or ""
        return m.group(0)

    def sub_phone(m: re.Match) -> str:
        if m.group(0).startswith("+") and not _international_digits_ok(m.group(0)):
            return m.group(0)
        counts["pii.phone"] += 1
        return cfg.phone or ""

    out = []
    for text in docs["text"].to_list():
        if text is None:
            out.append(None)
            continue
        if cfg.email is not None:
            text, n = _EMAIL.subn(cfg.email, text)
            counts["pii.email"] += n
        if cfg.ip is not None:
            text = _IPV6.sub(sub_ip, _IPV4.sub(sub_ip, text))
        if cfg.phone is not None:
            text = _PHONE.sub(sub_phone, text)
        out.append(text)
    return FilterResult(reasons=pl.Series([None] * docs.height, dtype=pl.Utf8),
                        texts=pl.Series(out, dtype=pl.Utf8), stats=counts)


# ---------------------------------------------------------------- URL block lists


@dataclass(frozen=True, kw_only=True)
class UrlFilterConfig:
    """Block lists for the ``url`` column.

    ``domains`` block a host and its subdomains (``example.com`` blocks ``www.example.com``);
    ``words`` block a URL with that word among its alphanumeric tokens (``casino`` blocks
    ``best-casino.net/x`` but not ``casinos.org``). ``blocklist_file`` adds entries, one per line:
    ``domain example.com`` or ``word casino``; ``#`` starts a comment. A relative path is taken from
    the repository root (where ``params/`` lives), whatever directory the run starts in (in an
    installed wheel, from the packaged defaults' root, :data:`tasks.common.params.PACKAGED_ROOT`).
    """

    domains: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    blocklist_file: str | None = None

    def __post_init__(self) -> None:
        if self.blocklist_file is not None:
            path = self.blocklist_path()
            require(path.is_file(), "blocklist_file", f"{path}: no such file")
            read_blocklist(str(path))  # a malformed line fails the config, naming file:line
        require(bool(self.domains or self.words or self.blocklist_file), "url_filter",
                "give domains, words or blocklist_file (an empty block list filters nothing)")

    def blocklist_path(self) -> Path:
        path = Path(self.blocklist_file or "")
        if path.is_absolute():
            return path
        # an installed wheel has no repository root: its packaged params/ stand in for it
        return REPO_ROOT / path if (REPO_ROOT / path).exists() else PACKAGED_ROOT / path

    def lists(self) -> tuple[frozenset[str], frozenset[str]]:
        domains = {d.lower().strip(".") for d in self.domains}
        words = {w.lower() for w in self.words}
        if self.blocklist_file is not None:
            fd, fw = read_blocklist(str(self.blocklist_path()))
            domains |= fd
            words |= fw
        return frozenset(domains), frozenset(words)


@functools.cache
def read_blocklist(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(domains, words)`` from a block-list file (format: :class:`UrlFilterConfig`)."""
    domains, words = set(), set()
    for i, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, value = line.partition(" ")
        value = value.strip().lower()
        if kind not in ("domain", "word") or not value or " " in value:
            raise ValueError(f"{path}:{i}: expected 'domain <name>' or 'word <word>', got {raw!r}")
        (domains if kind == "domain" else words).add(value.strip("."))
    return frozenset(domains), frozenset(words)


_URL_TOKEN = re.compile(r"[a-z0-9]+")
_said_no_url: set[str] = set()


def url_filter(docs: pl.DataFrame, cfg: UrlFilterConfig) -> FilterResult:
    """Drop documents whose ``url`` host is a blocked domain (``url_filter.blocked_domain``) or
    contains a blocked word (``url_filter.blocked_word``). Null or absent urls pass."""
    domains, words = cfg.lists()
    urls = docs["url"].to_list() if "url" in docs.columns else [None] * docs.height
    stats = {"url_filter.no_url": sum(u is None for u in urls)}
    if docs.height and stats["url_filter.no_url"] == docs.height:
        stats["url_filter.no_url_column"] = 1
        if "url" not in _said_no_url:
            _said_no_url.add("url")
            log.warning("url_filter: no document has a url; every document passes this step")
    reasons: list[str | None] = []
    for u in urls:
        if u is None:
            reasons.append(None)
            continue
        u = u.strip().lower()
        host = (urlsplit(u if "://" in u else "//" + u).hostname or "").strip(".")
        labels = host.split(".")
        if any(".".join(labels[i:]) in domains for i in range(len(labels))):
            reasons.append("url_filter.blocked_domain")
        elif words and not words.isdisjoint(_URL_TOKEN.findall(u)):
            reasons.append("url_filter.blocked_word")
        else:
            reasons.append(None)
    return FilterResult(reasons=pl.Series(reasons, dtype=pl.Utf8), stats=stats)


# ---------------------------------------------------------------- registry and token counts

#: Steps that read the working frame (``text`` and ``url``): name -> (config class, function).
CRAWL_FILTERS: dict[str, tuple[type, Callable[..., FilterResult]]] = {
    "language_id": (LanguageIdConfig, language_id),
    "pii": (PiiConfig, pii_normalize),
    "url_filter": (UrlFilterConfig, url_filter),
}


class BpeTokenCount:
    """``token_count`` for recipes: tokens of each text under the pipeline's BPE tokenizer
    (``data/tokenizer/tokenizer.json``, :mod:`tasks.training.tokenizer`), without special tokens.
    Picklable (holds the path), so process pools can ship it to shard workers."""

    def __init__(self, path: str | Path, *, batch_size: int = 1024):
        self.path = str(path)
        self.batch_size = batch_size
        self._tok = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "batch_size": self.batch_size, "_tok": None}

    @property
    def name(self) -> str:
        """How ``stats.json`` names this counter."""
        return f"tokenizer:{self.path}"

    def __call__(self, texts: pl.Series) -> pl.Series:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.path)
        items = texts.fill_null("").to_list()
        counts: list[int] = []
        for start in range(0, len(items), self.batch_size):
            enc = self._tok.encode_batch(items[start:start + self.batch_size], add_special_tokens=False)
            counts += [len(e.ids) for e in enc]
        return pl.Series(counts, dtype=pl.Int64)


def token_counter(spec: str, root: str | Path = ".") -> TokenCount:
    """The ``token_count`` a ``curation.token_count`` value names: ``words`` (whitespace words,
    :func:`~tasks.curation.text.whitespace_words`) or ``tokenizer:<path>`` (:class:`BpeTokenCount`
    of that tokenizers JSON file; a relative path is taken from ``root``). ``ValueError`` for
    another value, ``FileNotFoundError`` naming a missing tokenizer file."""
    problem = check_token_count(spec)
    if problem:
        raise ValueError(f"token_count: {problem}")
    if spec == "words":
        return whitespace_words
    path = Path(spec[len("tokenizer:"):].strip())
    path = path if path.is_absolute() else Path(root) / path
    if not path.is_file():
        raise FileNotFoundError(f"token_count: {spec}: no tokenizer file at {path}")
    return BpeTokenCount(path.resolve())
