"""Scoring ranked-classification items: each choice's summed log-likelihood, batched, and the per-item
predictions OLMo's ``ICLMetric`` makes from them.

Definitions follow ``olmo_eval.metrics.ICLMetric`` (OLMo's evaluation library, ``ai2-olmo-eval``;
Groeneveld et al. 2024, "OLMo: Accelerating the Science of Language Models", arXiv:2402.00838) and
OLMES (Gu et al. 2024, "OLMES: A Standard for Language Model Evaluations", arXiv:2406.08446):

* ``loglik = sum_t log p(cont_t | ctx, cont_<t)`` in nats;
* ``acc``: argmax of ``loglik``; ``len_norm``: argmax of ``loglik / len(continuation)`` in
  characters, leading space included (OLMES's ``acc_per_char``; the library's ``len_norm``);
* ``bpb`` of the gold answer: ``-loglik_gold / n_bytes(gold continuation) * log2(e)``.

Deviation (speed only, same numbers): the library runs one padded forward per (context,
continuation); here the tokens an item's choices share from the start run once (the choices as one
token tree under a tree attention mask, several items packed per row, no padding) and the output
head runs only at scored positions. Models without a 4D attention mask (xLSTM) run one chain per choice.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.common.config import at_least
from tasks.evaluation.requests import EncodedItem

LOG_2_OF_E = 1.44269504089  # the library's constant (olmo_eval.metrics.LOG_2_OF_E)


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
        at_least(self.batch_tokens, 16, "batch_tokens")
        at_least(self.row_tokens, 16, "row_tokens")
        at_least(self.progress, 0, "progress")


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
    mask has no window). Packing, not padding, is what makes sharing pay (token counts in
    docs/evaluation.md)."""
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
# Per-item predictions


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

