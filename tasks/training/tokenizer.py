"""Byte-level BPE tokenizer trained on the corpus, and token arrays stored as ``.npy``.

Byte-level BPE (GPT-2; Radford et al. 2019): every UTF-8 byte is in the base alphabet, so no text
is out of vocabulary. ``<|endoftext|>`` is id 0 and separates documents in the token stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tasks.common.io import atomic_path
from tasks.lm.tokenizer import EOS, eos_id

def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + EOS + merges).

    Fewer tokens come back only when the corpus runs out of pairs seen at least twice; size the
    model's embedding by ``vocab_size``, not by the result. Deterministic for the same texts.

    >>> tok = train_tokenizer(["hello world"] * 10, 300)
    >>> tok.decode(tok.encode("hello").ids)
    'hello'
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size: must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _batches(texts: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(texts)
    while batch := list(islice(it, n)):
        yield batch


def encode_corpus_segments(
    tokenizer: Tokenizer, texts: Iterable[str], batch_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """The token stream of :func:`encode_corpus` plus the document each token belongs to.

    Returns ``(tokens, doc_index)``, both shape ``(n_tokens,)``: ``tokens`` is each document's ids
    followed by the EOS id (uint16 when the vocabulary fits in 16 bits, else uint32);
    ``doc_index[i]`` (int32) is the 0-based position in ``texts`` of the document that token ``i``
    belongs to, its closing EOS included. An empty document contributes one EOS. Map documents to
    labels (source, variant) with ``labels[doc_index]`` and pass them, aligned to scored targets
    with :func:`tasks.lm.loss.target_indices`, to :func:`tasks.lm.loss.loss_by_group`.

    >>> toks, doc = encode_corpus_segments(tok, ["a b", "c"])  # doctest: +SKIP
    >>> doc.tolist()                                            # doctest: +SKIP
    [0, 0, 0, 0, 1, 1]
    """
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    eos = eos_id(tokenizer)
    parts: list[np.ndarray] = []
    for batch in _batches(texts, batch_size):
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=dtype)
            ids[:-1] = enc.ids
            ids[-1] = eos
            parts.append(ids)
    if not parts:
        return np.empty(0, dtype=dtype), np.empty(0, dtype=np.int32)
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    doc_index = np.repeat(np.arange(len(parts), dtype=np.int32), lengths)
    return np.concatenate(parts), doc_index


def encode_corpus(tokenizer: Tokenizer, texts: Iterable[str], batch_size: int = 1024) -> np.ndarray:
    """One flat token stream: each document's ids followed by the EOS id.

    Returns shape ``(n_tokens,)``, uint16 when the vocabulary fits in 16 bits, else uint32.
    The tokens of :func:`encode_corpus_segments` (same code path).
    """
    return encode_corpus_segments(tokenizer, texts, batch_size)[0]


def save_tokens(path: str | Path, arr: np.ndarray) -> Path:
    """Write a token array as ``.npy`` (no pickle), atomically."""
    path = Path(path)
    with atomic_path(path) as tmp:
        # np.save on a file name appends ".npy"; writing through a handle keeps the temp name.
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(arr), allow_pickle=False)
    return path


def load_tokens(path: str | Path, mmap: bool = True) -> np.ndarray:
    """Read a token array saved by :func:`save_tokens` (memory-mapped read-only by default)."""
    return np.load(Path(path), allow_pickle=False, mmap_mode="r" if mmap else None)
