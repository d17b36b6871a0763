"""The select flow with setting (b) on a tiny local model: reports/ddcf.csv rows carry their
setting, reports/ddcf.json records the pool per setting."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import torch

ROOT = Path(__file__).resolve().parents[2]


def _tiny_target(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.evaluation.downstream import load_requests
    from tasks.training.tokenizer import EOS, train_tokenizer

    texts = [s for t in ("arc_easy", "sciq") for it in load_requests(t, limit=100).items
             for s in (*it.contexts, *it.continuations)]
    tok = train_tokenizer(texts, 300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder


def test_select_flow_writes_setting_b_rows(prefect_harness, tmp_path: Path):
    from flows.select import select_flow

    target = _tiny_target(tmp_path / "target")
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    (root / "params" / "select.yaml").write_text(f"""select:
  settings: [olmo_eval]
  olmo_eval:
    tasks: [arc_easy, sciq]
    n_pool: 30
    n_seed: 12
    n_test: 16
    target: {target}
    pool: [rtn3, rtn2g16, drop1]
    calib_windows: 2
    model_ctx_len: 96
    finetune: {{steps: 2, batch_size: 4, lr: 1.0e-3}}
  predictor: {{epochs: 2}}
  k_fractions: [0.1]
  methods: [ddcf, random, full]
presets: {{}}
""")
    out = select_flow(root=str(root), preset="ci", workdir=str(tmp_path / "work"))
    table = pl.read_csv(tmp_path / "work" / "reports" / "ddcf.csv")
    assert table["setting"].unique().to_list() == ["olmo_eval"]
    assert table.select("method", "k", "labels_used").rows() == [("base", 0, 0), ("ddcf", 3, 15), ("random", 3, 3),
                                                                 ("full", 30, 30)]
    summary = json.loads((tmp_path / "work" / "reports" / "ddcf.json").read_text())
    assert summary["settings"]["olmo_eval"]["pool_models"] == ["target:rtn3", "target:rtn2g16", "target:drop1"]
    assert summary["config"]["olmo_eval"]["pool"] == ["rtn3", "rtn2g16", "drop1"]
    assert out["metrics"]["olmo_eval.target.predictor_auc"] == summary["metrics"]["olmo_eval.target.predictor_auc"]
