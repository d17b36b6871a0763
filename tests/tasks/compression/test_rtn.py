"""tasks.compression.rtn: per-group error bound, packing, the file on disk, and what it costs in perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.zoo.compressed import CompressedModel, load_compressed, save_compressed
from tasks.compression.rtn import RTNConfig, compress_rtn, quantized_linears
from tasks.zoo.decoders import grouped_int_state

VOCAB = 256


def tiny_llama(seed: int = 0, std: float = 0.1, tie: bool = False):
    """A random 2-layer Llama. ``std`` 0.1 (not HF's 0.02) makes next-token distributions peaked
    enough (entropy ~5.2 of a possible 5.55 nats) for quantization to show in the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      use_cache=False, tie_word_embeddings=tie, initializer_range=std)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(99))


@pytest.fixture(scope="module")
def compressed(model):
    return {bits: compress_rtn(model, RTNConfig(bits=bits, group_size=32)) for bits in (4, 8)}


def test_every_decoder_linear_is_quantized_and_the_head_is_not(model, compressed):
    cm = compressed[4]
    names = {n for n, _ in quantized_linears(model, RTNConfig().skip)}
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(n.startswith("model.layers.") for n in names)
    assert set(cm.meta["quantized"]) == {f"{n}.weight" for n in names}
    original = dict(model.named_parameters())
    for name, p in cm.model.named_parameters():
        changed = not torch.equal(p, original[name])
        assert changed == (name in cm.meta["quantized"]), name  # lm_head, embeddings, norms untouched


def test_input_model_is_left_unchanged(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compress_rtn(model, RTNConfig(bits=2, group_size=32))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bits", [4, 8])
def test_error_within_half_a_step_per_group(model, compressed, bits):
    cm = compressed[bits]
    weights = dict(model.named_parameters())
    deq = dict(cm.model.named_parameters())
    for key, spec in cm.meta["quantized"].items():
        rows, cols = spec["shape"]
        scale = cm.tensors[f"{key}.scales"].float()
        assert scale.shape == (rows, math.ceil(cols / 32))
        step = scale.repeat_interleave(32, dim=1)[:, :cols]
        err = (weights[key] - deq[key]).abs()
        assert (err <= step / 2 * (1 + 1e-5)).all(), key
        # Not vacuous: the step is about (range / levels), so errors are of that order, not zero.
        assert err.max() > step.min() / 10


def test_4bit_codes_are_packed_two_per_byte(compressed):
    cm = compressed[4]
    for key, spec in cm.meta["quantized"].items():
        rows, cols = spec["shape"]
        packed = cm.tensors[f"{key}.qweight"]
        assert packed.dtype == torch.uint8 and packed.shape == (rows, cols // 2)
        assert cm.tensors[f"{key}.scales"].dtype == torch.float16
        assert cm.tensors[f"{key}.zeros"].dtype == torch.float16
    bpw = cm.meta["bits_per_weight"]
    assert bpw == pytest.approx(4 + 2 * 16 / 32)  # codes + fp16 scale and zero per 32 weights


@pytest.mark.parametrize("bits", [4, 8])
def test_file_round_trip_reproduces_the_model(model, compressed, tokens, tmp_path, bits):
    cm = compressed[bits]
    path = tmp_path / f"w{bits}.safetensors"
    size = save_compressed(cm, path)
    assert size == path.stat().st_size
    stored, meta = load_compressed(path)
    assert meta["method"] == "rtn" and meta["config"]["bits"] == bits
    fresh = tiny_llama(seed=123)  # different weights, all replaced from the file
    fresh.load_state_dict(grouped_int_state(stored, meta), strict=True)
    for k, v in cm.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=tokens).logits, cm.model(input_ids=tokens).logits)


def test_bytes_on_disk_follow_the_bit_width(model, compressed, tmp_path):
    fp = CompressedModel(model=model, tensors=dict(model.state_dict()), meta={"method": "none"})
    sizes = {"fp32": save_compressed(fp, tmp_path / "fp32.safetensors")}
    payloads = {"fp32": sum(t.numel() * t.element_size() for t in fp.tensors.values())}
    for bits, cm in compressed.items():
        sizes[bits] = save_compressed(cm, tmp_path / f"w{bits}.safetensors")
        payloads[bits] = sum(t.numel() * t.element_size() for t in cm.tensors.values())
        assert payloads[bits] < sizes[bits] < payloads[bits] + 32_768  # data + a JSON header, nothing else
    # Quantized linears hold ~82k of the ~115k parameters; embeddings and head stay fp32.
    n_q = compressed[4].meta["n_quantized_params"]
    assert n_q == 2 * (4 * 64 * 64 + 3 * 64 * 128)
    # fp32 (4 bytes) -> 4-bit codes (0.5) + fp16 scale and zero per 32 weights (4/32).
    assert payloads["fp32"] - payloads[4] == n_q * (4 - 0.5 - 4 / 32)
    assert payloads["fp32"] - payloads[8] == n_q * (4 - 1 - 4 / 32)
    assert sizes[4] < sizes[8] < sizes["fp32"]


def _expected_nll(model, reference_logp, tokens):
    """Cross-entropy of ``model`` against the fp model's own next-token distribution (nats/token).

    Equals the fp model's entropy plus KL(fp || model), so a perturbed model can only score worse:
    unlike a loss on random labels, the change is not noise around zero.
    """
    with torch.no_grad():
        logq = model(input_ids=tokens).logits.float().log_softmax(-1)
    return -(reference_logp.exp() * logq).sum(-1).mean().item()


def test_perplexity_degrades_a_little_at_8_bits_and_more_at_4(model, compressed, tokens):
    with torch.no_grad():
        logp = model(input_ids=tokens).logits.float().log_softmax(-1)
    base = _expected_nll(model, logp, tokens)
    nll = {bits: _expected_nll(cm.model, logp, tokens) for bits, cm in compressed.items()}
    ppl = {k: math.exp(v) for k, v in (nll | {"fp": base}).items()}
    assert ppl["fp"] < ppl[8] < ppl[4]
    assert ppl[8] / ppl["fp"] < 1 + 1e-3  # 8 bits: a little (measured ~1.00008)
    assert ppl[4] / ppl["fp"] > 1 + 5e-3  # 4 bits: clearly (measured ~1.02)
    assert (nll[4] - base) > 20 * (nll[8] - base)  # 16x finer steps: ~256x less KL
    # The loss the pipeline reports (labels = the tokens) stays finite and near the fp model's.
    with torch.no_grad():
        fp_loss = model(input_ids=tokens, labels=tokens).loss.item()
        q_loss = compressed[8].model(input_ids=tokens, labels=tokens).loss.item()
    assert abs(q_loss - fp_loss) < 0.01


def test_tied_head_cannot_be_quantized_silently():
    tied = tiny_llama(tie=True)
    with pytest.raises(ValueError, match="tied"):
        compress_rtn(tied, RTNConfig(bits=4, group_size=32, skip=()))
    cm = compress_rtn(tied, RTNConfig(bits=4, group_size=32))
    assert cm.meta["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in cm.tensors


def test_tied_model_round_trips(tmp_path):
    tied = tiny_llama(seed=1, tie=True)
    cm = compress_rtn(tied, RTNConfig(bits=3, group_size=20))  # 3 bits, groups not dividing 64
    save_compressed(cm, tmp_path / "tied.safetensors")
    state = grouped_int_state(*load_compressed(tmp_path / "tied.safetensors"))
    for k, v in cm.model.state_dict().items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("bad", [{"bits": 1}, {"bits": 9}, {"group_size": 0}], ids=["bits1", "bits9", "group0"])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        RTNConfig(**bad)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_load_compressed_model_gives_the_same_logits(model, tokens, tmp_path, symmetric):
    from tasks.zoo.compressed import load_compressed_model

    cm = compress_rtn(model, RTNConfig(bits=3, group_size=24, symmetric=symmetric))
    path = tmp_path / "m.safetensors"
    save_compressed(cm, path)
    loaded = load_compressed_model(path, model)
    assert loaded is not model and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, cm.model(input_ids=tokens).logits)
        assert not torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    assert ("model.layers.0.mlp.up_proj.weight.zeros" in cm.tensors) == (not symmetric)


def test_symmetric_rtn_stores_no_zeros_and_keeps_the_error_bound(model):
    cm = compress_rtn(model, RTNConfig(bits=4, group_size=32, symmetric=True))
    assert cm.meta["bits_per_weight"] == pytest.approx(4 + 16 / 32)
    w = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    deq = dict(cm.model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    step = cm.tensors["model.layers.1.mlp.down_proj.weight.scales"].float().repeat_interleave(32, dim=1)
    assert ((w - deq).abs() <= step / 2 * (1 + 1e-5)).all()


def test_a_mismatched_or_malformed_artifact_is_refused(model, tmp_path):
    from tasks.zoo.compressed import load_compressed_model

    cm = compress_rtn(model, RTNConfig(bits=4, group_size=32))
    save_compressed(cm, tmp_path / "ok.safetensors")
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    with pytest.raises(ValueError, match="shapes differ from the base model"):
        load_compressed_model(tmp_path / "ok.safetensors", other)
    bad_bits = CompressedModel(model=cm.model, tensors=cm.tensors, meta=cm.meta | {
        "quantized": {k: v | {"bits": 11} for k, v in cm.meta["quantized"].items()}})
    save_compressed(bad_bits, tmp_path / "bits.safetensors")
    with pytest.raises(ValueError, match="unknown bit width 11"):
        load_compressed_model(tmp_path / "bits.safetensors", model)
    key = "model.layers.0.self_attn.q_proj.weight.scales"
    wrong = CompressedModel(model=cm.model, tensors=cm.tensors | {key: cm.tensors[key][:, :1]}, meta=cm.meta)
    save_compressed(wrong, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match="shape.safetensors: scale/zero: expected shape"):
        load_compressed_model(tmp_path / "shape.safetensors", model)
    missing = CompressedModel(model=cm.model, tensors={k: v for k, v in cm.tensors.items() if k != key}, meta=cm.meta)
    save_compressed(missing, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="missing tensor"):
        load_compressed_model(tmp_path / "missing.safetensors", model)
    no_meta = CompressedModel(model=cm.model, tensors=cm.tensors, meta={})
    save_compressed(no_meta, tmp_path / "nometa.safetensors")
    with pytest.raises(ValueError, match="no scalelab metadata"):
        load_compressed_model(tmp_path / "nometa.safetensors", model)


def test_export_dequantized_loads_with_from_pretrained(model, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    from tasks.zoo.compressed import export_dequantized

    cm = compress_rtn(model, RTNConfig(bits=4, group_size=32))
    out = export_dequantized(cm.model, tmp_path / "hf")
    again = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, cm.model(input_ids=tokens).logits)
