"""The tokenizer interface scoring needs, and scalelab's tokenizers behind it.

:class:`TextTokenizer` is the shape of ``olmo_eval.tokenizer.Tokenizer`` (OLMo's evaluation library,
``ai2-olmo-eval``; Groeneveld et al. 2024, "OLMo: Accelerating the Science of Language Models",
arXiv:2402.00838); :class:`TokenizerAdapter` puts a ``tokenizers.Tokenizer`` (the ladder's byte-level
BPE) or a transformers tokenizer (SmolLM2's) behind it. Deviation: no BOS is prepended (the ladder's
training stream has none, and lm-evaluation-harness adds none for HF models by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

#: The ladder tokenizer's end-of-text token (id 0): it separates documents in the token stream.
EOS = "<|endoftext|>"


class TextTokenizer(Protocol):
    """What scoring needs of a tokenizer; also the shape of ``olmo_eval.tokenizer.Tokenizer``."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def pad_token_id(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    def encode_batch(self, inputs: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]: ...


class TokenizerAdapter:
    """scalelab's tokenizers behind the interface of ``olmo_eval.tokenizer.Tokenizer``.

    Wraps a ``tokenizers.Tokenizer`` (the ladder's byte-level BPE) or a transformers tokenizer
    (SmolLM2's). ``bos_token_id`` is None for both — no BOS is prepended, as in the ladder's
    training stream and lm-evaluation-harness's default for HF models. :meth:`as_olmo_eval`
    registers the class as a virtual subclass of the library's ABC so ``build_task`` accepts it.
    """

    def __init__(self, tokenizer: Any, *, eos_token_id: int, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, name: str = "") -> None:
        self._tok = tokenizer
        self._eos = int(eos_token_id)
        self._pad = int(pad_token_id if pad_token_id is not None else eos_token_id)
        self._bos = bos_token_id
        self.name = name
        self._fast = hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "get_vocab_size")

    @property
    def vocab_size(self) -> int:
        if self._fast:
            return int(self._tok.get_vocab_size(with_added_tokens=True))
        return int(len(self._tok))

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, input: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([input], add_special_tokens=add_special_tokens)[0]

    def encode_batch(self, inputs: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        if self._fast:
            ids = [e.ids for e in self._tok.encode_batch(list(inputs), add_special_tokens=False)]
        else:
            ids = [list(x) for x in self._tok(list(inputs), add_special_tokens=False)["input_ids"]]
        if add_special_tokens:  # as olmo_eval.tokenizer.HFTokenizer: EOS appended, BOS prepended if any
            for x in ids:
                if not x or x[-1] != self._eos:
                    x.append(self._eos)
                if self._bos is not None and x[0] != self._bos:
                    x.insert(0, self._bos)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_batch([token_ids], skip_special_tokens)[0]

    def decode_batch(self, batch_token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        if self._fast:
            return self._tok.decode_batch([list(t) for t in batch_token_ids], skip_special_tokens=skip_special_tokens)
        return self._tok.batch_decode([list(t) for t in batch_token_ids], skip_special_tokens=skip_special_tokens)

    def as_olmo_eval(self) -> "TokenizerAdapter":
        """This adapter, registered as an ``olmo_eval.tokenizer.Tokenizer`` (imports the library)."""
        from olmo_eval.tokenizer import Tokenizer

        Tokenizer.register(TokenizerAdapter)
        return self


def check_vocabulary(tokenizer: TextTokenizer, model_vocab_size: int, *, model: str = "model",
                     tokenizer_name: str = "tokenizer") -> None:
    """``ValueError`` when the tokenizer can emit ids the model has no embedding for."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"{model}: vocabulary mismatch: {tokenizer_name} has {tokenizer.vocab_size} tokens but "
                         f"the model's embedding has {model_vocab_size} rows")


def eos_id(tokenizer: Any) -> int:
    """The id of :data:`EOS` in a ``tokenizers.Tokenizer``; ``ValueError`` when it has none."""
    i = tokenizer.token_to_id(EOS)
    if i is None:
        raise ValueError(f"tokenizer has no {EOS} token")
    return i
