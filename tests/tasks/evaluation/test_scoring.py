"""Scoring against OLMo's own library (ai2-olmo-eval) on hand-picked items: log-likelihoods, the
shared-context trees against one forward per choice, and ICLMetric's predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.evaluation.requests import EncodedItem, TaskItem, encode_items, load_requests
from tasks.evaluation.scoring import LOG_2_OF_E, ScoringConfig, _plan, _tree, item_results, score_encoded
from tasks.evaluation.stats import task_summary
from tests.tasks.evaluation.olmo_support import CTX, WIDE, library_task, needs_olmo_eval

pytestmark = needs_olmo_eval


@pytest.mark.parametrize("task,metric", [("arc_easy", "acc"), ("piqa", "len_norm"), ("winogrande", "acc")])
def test_accuracy_and_bpb_match_icl_metric(task, metric, neox, model):
    """The library scores its own padded batches (one full forward per choice) with ICLMetric; we score the
    same items with a shared context and must get the same per-item predictions and the same numbers."""
    from olmo_eval import ICLMetric

    n = 12
    lib = library_task(f"{task}_rc_0shot", neox, WIDE)
    mine = [s for s in lib.samples if s["doc_id"] < n]
    metrics = {t: ICLMetric(metric_type=t) for t in ("acc", "len_norm")}
    with torch.no_grad():
        for i in range(0, len(mine), 8):
            batch = lib.collate_fn(mine[i : i + 8])
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            for m in metrics.values():
                m.update(batch, logits)
    ref = {t: m.compute() for t, m in metrics.items()}
    encoded = encode_items(load_requests(task, limit=n).items, neox, model_ctx_len=WIDE)
    results = item_results(encoded, score_encoded(model, encoded, ScoringConfig(), pad_token_id=1))
    summary = task_summary(results, primary_metric=metric)
    assert summary["acc"] == pytest.approx(float(ref["acc"]["acc_v1"]), abs=1e-6)  # the library returns float32
    assert summary["len_norm"] == pytest.approx(float(ref["len_norm"]["len_norm_v1"]), abs=1e-6)  # the library returns float32
    assert summary["bpb"] == pytest.approx(float(ref["acc"]["bpb_v2"]), rel=1e-4)
    # per item: the library's log-likelihood table against ours
    table = {}
    for doc, cont, ll in metrics["acc"].loglikelihoods:
        table.setdefault(doc, {})[cont] = ll
    for r in results:
        lib_ll = [table[r.doc_id][k] for k in range(len(r.loglik))]
        np.testing.assert_allclose(r.loglik, lib_ll, rtol=1e-4, atol=1e-3)
        assert r.pred_acc == int(np.argmax(lib_ll))


@pytest.mark.parametrize("batch_tokens", [16, 333, 4096])
@pytest.mark.parametrize("task", ["hellaswag", "winogrande"])  # one context per item; one per choice
def test_shared_context_equals_one_forward_per_choice(task, batch_tokens, neox, model):
    encoded = encode_items(load_requests(task, limit=9).items, neox, model_ctx_len=CTX)
    shared = score_encoded(model, encoded, ScoringConfig(batch_tokens=batch_tokens), pad_token_id=1)
    full = score_encoded(model, encoded, ScoringConfig(batch_tokens=batch_tokens, shared_context="never"),
                         pad_token_id=1)
    for a, b in zip(shared, full):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def _reference_logliks(model, encoded) -> list[np.ndarray]:
    """One full forward per (context, continuation), no batching: the definition."""
    out = []
    with torch.no_grad():
        for e in encoded:
            ll = []
            for ctx, cont in zip(e.ctxs, e.conts):
                ids = torch.tensor([ctx + cont[:-1]])
                logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)
                ll.append(sum(float(logp[len(ctx) - 1 + t, c]) for t, c in enumerate(cont)))
            out.append(np.array(ll))
    return out


def _synthetic_items(seed: int, vocab: int) -> list:
    """Items of varied shapes: a shared context and continuations that share their first tokens;
    Winogrande-style choices whose contexts differ at the first token or after a few, with the same
    continuation; a choice repeated verbatim; one item of 70 tokens (longer than a 32-token row)."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return tuple(int(x) for x in rng.integers(1, vocab, n))

    shapes = []
    for n_ctx in (1, 3, 9, 17):
        ctx, stem = toks(n_ctx), toks(2)
        shapes.append(([ctx] * 3, [toks(1), stem + toks(3), stem + toks(5)]))
    for n_shared in (0, 4):
        head, tail, cont = toks(n_shared), toks(6), toks(4)
        shapes.append(([head + toks(1) + tail, head + toks(2) + tail], [cont, cont]))
    ctx, cont = toks(5), toks(3)
    shapes.append(([ctx, ctx], [cont, cont]))
    ctx = toks(60)
    shapes.append(([ctx] * 2, [toks(8), toks(11)]))
    items = []
    for d, (ctxs, conts) in enumerate(shapes):
        item = TaskItem(task="t", doc_id=d, gold=0, contexts=("",) * len(ctxs), continuations=("",) * len(ctxs))
        items.append(EncodedItem(item=item, ctxs=tuple(ctxs), conts=tuple(conts), cont_chars=(1,) * len(ctxs),
                                 cont_bytes=(1,) * len(ctxs)))
    return [items[i] for i in rng.permutation(len(items))]


@pytest.mark.parametrize("batch_tokens", [32, 100, 4096])
def test_packed_trees_equal_one_full_forward_per_request(batch_tokens):
    """Several items per row, each under its tree mask with its own positions, and an item longer
    than a row alone: every choice's log-likelihood is the one of its own full forward."""
    from tasks.lm.model import ModelShape
    from tasks.lm.model import build_model

    vocab = 97
    model = build_model(ModelShape(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2), vocab, 128, seed=5).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model.lm_head.weight.normal_(0.0, 1.0)  # choices differ clearly
    encoded = _synthetic_items(0, vocab)
    cfg = ScoringConfig(batch_tokens=batch_tokens, row_tokens=32)
    plan = _plan(encoded, cfg, trees=True)
    assert all(b.packed for b in plan)
    assert any(len(row) > 1 for b in plan for row in b.rows)  # items share rows
    if batch_tokens > 100:
        assert any(len(b.rows) > 1 for b in plan)  # rows share forwards
    assert max(len(t) for b in plan for row in b.rows for t in row) > cfg.row_tokens  # the long item ran
    ref = _reference_logliks(model, encoded)
    for got, want in zip(score_encoded(model, encoded, cfg, pad_token_id=0), ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # a sliding window shorter than the long item sends it (only it) to one chain per choice
    plan = _plan(encoded, cfg, trees=True, window=40)
    assert sorted({t.item for b in plan if not b.packed for row in b.rows for t in row}) == [
        i for i, e in enumerate(encoded) if len(e.ctxs[0]) > 40]
    model.config.sliding_window = 40
    try:
        for got, want in zip(score_encoded(model, encoded, cfg, pad_token_id=0), ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    finally:
        model.config.sliding_window = None


def test_choices_share_the_tokens_they_have_in_common_from_the_start(neox):
    """Winogrande's choices differ in the option word inside the context: the words before it run once."""
    encoded = encode_items(load_requests("winogrande", limit=20).items, neox, model_ctx_len=WIDE)
    shared = 0
    for i, e in enumerate(encoded):
        t = _tree(i, e, range(e.item.n_choices))
        requests = [e.ctxs[k] + e.conts[k][:-1] for k in range(e.item.n_choices)]
        assert len(t) < sum(len(r) for r in requests)
        shared += len(t) < sum(len(r) for r in requests) - 1  # more than the first token
        anc = t.ancestors()
        assert [k for k, _, _ in t.reads] == list(range(e.item.n_choices))
        for (k, nodes, cont), request in zip(t.reads, requests):
            assert tuple(cont) == e.conts[k]
            last = nodes[-1]  # its ancestors, in depth order, are the request's tokens
            path = np.flatnonzero(anc[last])
            assert [t.tokens[n] for n in path] == list(request)
            assert [t.depth[n] for n in path] == list(range(len(request)))
            assert list(path[len(e.ctxs[k]) - 1:]) == nodes
    assert shared > 0


def test_bpb_and_length_normalisation_follow_the_definitions():
    item = TaskItem(task="t", doc_id=0, gold=1, contexts=("Q:",) * 3, continuations=(" a", " bbbb", " é"))
    enc = EncodedItem(item=item, ctxs=((1,),) * 3, conts=((2,), (3,), (4,)), cont_chars=(2, 5, 2),
                      cont_bytes=(2, 5, 3))
    (r,) = item_results([enc], [np.array([-2.0, -4.0, -2.0])])
    assert r.pred_acc == 0  # a tie goes to the first choice, as torch.argmax
    assert r.pred_len_norm == 1  # -4/5 > -2/2
    assert r.bpb == pytest.approx(4.0 / 5 * LOG_2_OF_E)
