"""`scalelab prune` and `scalelab distill` on a tiny local model and a JSONL text file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flows.cli import main
from flows.prune import parse_options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.training.tokenizer import train_tokenizer
    from tasks.lm.tokenizer import EOS

    tmp = tmp_path_factory.mktemp("cli")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 80))) for _ in range(120)]
    text = tmp / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_tokenizer(docs, 300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    folder = tmp / "teacher"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder, text


def test_prune_then_distill_write_loadable_models(model_and_text, tmp_path: Path):
    from tasks.zoo.models import load_causal_lm

    teacher, text = model_and_text
    common = ["--text", str(text), "--eval-tokens", "512", "--eval-seq-len", "32", "--root", str(ROOT), "--preset", "ci"]
    assert main(["prune", "--model", str(teacher), "--method", "cosine_drop", "--set", "n_remove=2",
                 "--set", "seq_len=32", "--out", str(tmp_path / "pruned"), "--calib-tokens", "512", *common]) == 0
    record = json.loads((tmp_path / "pruned" / "scalelab.json").read_text())
    assert record["method"] == "cosine_drop" and len(record["result"]["removed"]) == 2
    assert record["params_after"] < record["params_before"]
    pruned, _, _ = load_causal_lm(tmp_path / "pruned")
    assert pruned.config.num_hidden_layers == 2
    assert main(["distill", "--teacher", str(teacher), "--student", str(tmp_path / "pruned"), "--loss", "kl",
                 "--data-select", "random", "--budget", "0.5", "--steps", "2", "--batch-size", "2", "--tokens", "1024",
                 "--seq-len", "32", "--curve-every", "1", "--out", str(tmp_path / "recovered"), *common]) == 0
    pruned_after = record["ppl_after"]
    record = json.loads((tmp_path / "recovered" / "scalelab.json").read_text())
    # the saved student, scored again before recovery, is the model prune scored (same text, context, dtype)
    assert record["ppl_before"] == pytest.approx(pruned_after, rel=1e-4)
    assert record["windows"] == 16 and record["candidates"] == 32 and record["tokens"] == 2 * 2 * 32
    # the recovery curve: before, after each step (--curve-every 1), ending at the reported perplexity
    assert [(p["step"], p["recovery_tokens"]) for p in record["curve"]] == [(0, 0), (1, 64), (2, 128)]
    assert record["curve"][0]["ppl"] == record["ppl_before"] and record["curve"][-1]["ppl"] == record["ppl_after"]
    recovered, _, _ = load_causal_lm(tmp_path / "recovered")
    diff = [(a - b).abs().max().item() for a, b in zip(recovered.parameters(), pruned.parameters())]
    assert max(diff) > 0  # it trained


def test_bad_options_are_named(model_and_text, tmp_path: Path, capsys):
    teacher, text = model_and_text
    assert main(["prune", "--model", str(teacher), "--method", "cosine_drop", "--set", "n_remov=2",
                 "--out", str(tmp_path / "x"), "--text", str(text), "--root", str(ROOT)]) == 2
    assert "n_remov" in capsys.readouterr().err
    assert main(["prune", "--model", str(teacher), "--method", "magnitude", "--out", str(tmp_path / "x"),
                 "--root", str(ROOT)]) == 2
    assert "unknown pruning method 'magnitude'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected key=value"):
        parse_options(["n_remove"])
    assert parse_options(["n_remove=2", "granularity=mlp"]) == {"n_remove": 2, "granularity": "mlp"}
    assert not (tmp_path / "x").exists()
