"""tasks.sparse.retrieval: the needle-in-a-haystack set (structure, determinism, needle placement,
lengths) and its likelihood-ranked scoring, dense and under sparse handles, on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.lm.tokenizer import TokenizerAdapter
from tasks.sparse.quoka import QuokaConfig, quoka
from tasks.sparse.retrieval import (NEEDLE, QUESTION, RetrievalConfig, build_retrieval_set, candidate_logliks,
                                    retrieval_accuracy, score_retrieval)
from tasks.sparse.teal import TealConfig
from tasks.sparse.registry import sparsify

WORDS = ("river stone market quiet bright evening garden letter window morning table orange city "
         "music paper winter small people travel house").split()


def _texts(n_docs: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [" ".join(rng.choice(WORDS, rng.integers(2, 6))).capitalize() + "." for _ in range(12)]
        docs.append(" ".join(sentences))
    return docs


TEXTS = _texts()


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE trained on the filler words (digits stay bytes, so codes are 5+ tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=420, special_tokens=["<eos>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return TokenizerAdapter(t, eos_token_id=0, name="tiny-bpe")


@pytest.fixture(scope="module")
def model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, use_cache=True,
                      tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


CFG = RetrievalConfig(lengths=(128, 300), depths=(0.0, 0.25, 0.5, 0.9, 1.0), items_per_depth=2, n_distractors=5,
                      snap_tokens=12, seed=3)


@pytest.fixture(scope="module")
def items(tok):
    return build_retrieval_set(tok, TEXTS, CFG)


def test_structure_and_token_lengths(tok, items):
    assert len(items) == 2 * 5 * 2
    assert [(i.context_tokens, i.depth) for i in items[:: CFG.items_per_depth]] == [
        (n, d) for n in CFG.lengths for d in CFG.depths]
    for item in items:
        assert len(item.prompt) == item.context_tokens
        assert len(item.candidates) == CFG.n_distractors + 1
        codes = [tok.decode(list(c)) for c in item.candidates]
        assert len(set(codes)) == len(codes)
        assert all(len(c) == 7 and c[0] == " " and c[1:6].isdigit() and c[6] == "." for c in codes)
        assert codes[item.answer] == f" {item.code}."
        question = QUESTION.format(name=item.name)
        assert tok.decode(list(item.prompt)).endswith(question)


def test_the_needle_is_in_the_haystack_at_its_depth(tok, items):
    for item in items:
        needle = tok.decode(list(item.prompt[item.needle_start : item.needle_start + item.needle_len]))
        assert needle == " " + NEEDLE.format(name=item.name, code=item.code)
        question_len = len(tok.encode(QUESTION.format(name=item.name), add_special_tokens=False))
        haystack = item.context_tokens - item.needle_len - question_len
        assert abs(item.needle_start - item.depth * haystack) <= CFG.snap_tokens
        if 0 < item.needle_start:  # sentences here are 2-5 words: a sentence end is always within the window
            assert tok.decode([item.prompt[item.needle_start - 1]]).endswith((".", "\n"))
        # the code appears once in the prompt: in the needle
        assert tok.decode(list(item.prompt)).count(item.code) == 1


def test_the_set_is_a_function_of_the_seed(tok, items):
    again = build_retrieval_set(tok, TEXTS, CFG)
    assert again == items
    other = build_retrieval_set(tok, TEXTS, RetrievalConfig(**{**CFG.__dict__, "seed": 4}))
    assert [i.code for i in other] != [i.code for i in items]
    assert len({i.answer for i in items}) > 1  # the true number is not always in the same slot


def test_too_little_text_and_bad_settings_are_refused(tok):
    with pytest.raises(ValueError, match="fewer than the"):
        build_retrieval_set(tok, TEXTS[:1], RetrievalConfig(lengths=(2000,), depths=(0.5,)))
    with pytest.raises(ValueError, match="depths"):
        RetrievalConfig(depths=(1.5,))
    with pytest.raises(ValueError, match="n_distractors"):
        RetrievalConfig(n_distractors=0)
    with pytest.raises(ValueError, match="lengths"):
        RetrievalConfig(lengths=(32,))


def _full_sequence_loglik(model, prompt, cont) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(cont)]), use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return float(sum(logp[n - 1 + j, t] for j, t in enumerate(cont)))


def test_cached_batched_scores_equal_one_forward_per_candidate(model, items):
    for item in items[:3] + items[-2:]:
        got = candidate_logliks(model, item)
        want = [_full_sequence_loglik(model, item.prompt, c) for c in item.candidates]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_candidate_of_one_token_is_scored_by_the_prompt_alone(model, items):
    item = items[0]
    single = type(item)(**{**item.__dict__, "candidates": tuple(c[:1] for c in item.candidates)})
    got = candidate_logliks(model, single)
    want = [_full_sequence_loglik(model, item.prompt, c[:1]) for c in item.candidates]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_scores_frame_and_accuracy(model, items):
    scores = score_retrieval(model, items)
    assert scores.height == len(items)
    assert scores["correct"].to_list() == [m > 0 for m in scores["margin"].to_list()]
    assert retrieval_accuracy(scores) == pytest.approx(float(np.mean(scores["correct"].to_list())))
    per = retrieval_accuracy(scores, by="context_tokens")
    assert per["context_tokens"].to_list() == list(CFG.lengths) and per["items"].to_list() == [10, 10]


def test_sparse_prefill_changes_the_scores_and_the_answer_pass_is_dense(model, items):
    item = items[-1]  # 300 tokens: QuoKA's chunks of 32 have earlier keys to drop
    dense = candidate_logliks(model, item)
    impl = model.config._attn_implementation
    handle = quoka(model, QuokaConfig(sparsities=(0.75,), chunk_size=32, min_keys=4), sparsity=0.75)
    sparse = candidate_logliks(model, item, handle)
    assert model.config._attn_implementation == impl and not handle.active
    assert not np.allclose(sparse, dense, atol=1e-6)
    # the counted pairs are the prompt's alone: the candidates ran with exact attention
    n = len(item.prompt)
    assert handle.visible == 4 * n * (n + 1) // 2 * model.config.num_hidden_layers
    again = candidate_logliks(model, item, handle, sparse_answer=True)  # the answer pass under the handle too
    assert handle.visible > 2 * 4 * n * (n + 1) // 2 * model.config.num_hidden_layers
    assert np.isfinite(again).all()


def test_activation_sparsity_stays_on_for_the_answer(model, items):
    handle = sparsify(model, TealConfig(sparsities=(0.5,), mode="topk"), sparsity=0.5)
    item = items[0]
    scores = candidate_logliks(model, item, handle)
    assert not handle.active and np.isfinite(scores).all()
    n_answer_rows = len(item.candidates) * (max(len(c) for c in item.candidates) - 1)
    per_call = sum(handle._total.values())  # entries seen: prompt rows plus the candidates' rows
    width = sum(m.in_features for m, _ in handle.sites.values())
    assert per_call == width * (len(item.prompt) + n_answer_rows)
    assert handle.achieved_sparsity() == pytest.approx(0.5, abs=0.01)


def test_an_item_longer_than_the_context_is_refused(tok, model):
    long = build_retrieval_set(tok, TEXTS, RetrievalConfig(lengths=(510,), depths=(0.5,)))
    with pytest.raises(ValueError, match="longer than the model's 512-token context"):
        candidate_logliks(model, long[0])
    assert math.isfinite(candidate_logliks(model, build_retrieval_set(
        tok, TEXTS, RetrievalConfig(lengths=(500,), depths=(0.5,)))[0]).max())
