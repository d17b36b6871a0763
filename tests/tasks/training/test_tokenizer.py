from __future__ import annotations

import numpy as np
import pytest

from tasks.training.tokenizer import encode_corpus, encode_corpus_segments, load_tokens, save_tokens, train_tokenizer
from tasks.lm.tokenizer import EOS, eos_id

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Scaling laws relate loss to parameters and tokens.",
    "Ünïcödé text — with ✓ symbols and emoji 🦊 survives byte-level BPE.",
] * 40


def test_train_is_deterministic_and_sized():
    a = train_tokenizer(TEXTS, 320)
    b = train_tokenizer(TEXTS, 320)
    assert a.get_vocab() == b.get_vocab()
    assert 257 < a.get_vocab_size() <= 320
    assert eos_id(a) == 0 and a.id_to_token(0) == EOS


def test_roundtrip_any_text():
    tok = train_tokenizer(TEXTS, 320)
    unseen = "zebra ქართული 123 \t\n end"
    assert tok.decode(tok.encode(unseen).ids) == unseen


def test_encode_corpus_joins_documents_with_eos():
    tok = train_tokenizer(TEXTS, 320)
    docs = ["first document", "second one", ""]
    arr = encode_corpus(tok, docs, batch_size=2)
    assert arr.dtype == np.uint16
    eos_positions = np.flatnonzero(arr == eos_id(tok))
    assert len(eos_positions) == 3 and eos_positions[-1] == len(arr) - 1
    first = arr[: eos_positions[0]].tolist()
    assert tok.decode(first) == "first document"
    assert arr.tolist() == encode_corpus(tok, docs, batch_size=1024).tolist()  # batching doesn't matter


def test_encode_corpus_segments_labels_each_token_with_its_document():
    tok = train_tokenizer(TEXTS, 320)
    docs = ["first document", "", "second one, a little longer", "x"]
    arr, doc = encode_corpus_segments(tok, docs, batch_size=3)
    assert arr.tolist() == encode_corpus(tok, docs).tolist()  # the same stream
    assert doc.dtype == np.int32 and doc.shape == arr.shape
    assert np.all(np.diff(doc) >= 0) and doc[0] == 0 and doc[-1] == len(docs) - 1
    eos = eos_id(tok)
    for i, text in enumerate(docs):
        mine = arr[doc == i]
        assert mine[-1] == eos and not np.any(mine[:-1] == eos)  # each document closes on its own EOS
        assert tok.decode(mine[:-1].tolist()) == text
    assert np.sum(doc == 1) == 1  # the empty document is one EOS
    empty_arr, empty_doc = encode_corpus_segments(tok, [])
    assert empty_arr.size == 0 and empty_doc.dtype == np.int32 and empty_doc.size == 0


def test_small_vocab_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TEXTS, 100)


def test_save_load_roundtrip(tmp_path):
    arr = np.arange(1000, dtype=np.uint16)
    path = save_tokens(tmp_path / "train.npy", arr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.npy"]  # no temp file left behind
    back = load_tokens(path)
    assert back.dtype == np.uint16 and np.array_equal(back, arr)
    assert np.array_equal(load_tokens(path, mmap=False), arr)


def test_save_refuses_object_arrays(tmp_path):
    with pytest.raises(ValueError):
        save_tokens(tmp_path / "bad.npy", np.array([object()], dtype=object))
    assert not list(tmp_path.iterdir())
