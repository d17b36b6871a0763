"""flows.prune: the rows pruning.save keeps are logged as MLflow models by reference, with their
metrics linked, and load back through ``mlflow.pyfunc`` with the kept folder's logits."""

from __future__ import annotations

import random
from pathlib import Path

import mlflow
import numpy as np
import torch

from flows.prune import _logger, _saver, pruned_model_key
from tasks.common.lineage import _process_tracking_uri, data_ref, find_models
from tasks.common.tracking import tracked_run
from tasks.compression.pruning import PruningConfig, RecoveryConfig, SaveConfig, prune_rows

VOCAB = 300


def tiny_model_and_tokenizer(tmp_path: Path):
    """A random 3-layer Llama over a byte-level BPE of 300 tokens (the ladder's tokenizer kind)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.zoo.models import ladder_tokenizer
    from tasks.training.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    tok = train_tokenizer([" ".join(rng.choice(words) for _ in range(60)) for _ in range(80)], VOCAB)
    tok.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval(), ladder_tokenizer(tmp_path / "tokenizer.json")


def test_kept_pruned_models_are_logged_by_reference_and_load_through_pyfunc(tmp_path: Path):
    from tasks.zoo.models import load_causal_lm

    model, tok = tiny_model_and_tokenizer(tmp_path)
    rng = np.random.default_rng(0)
    calib, train, val = (rng.integers(0, VOCAB, n).astype(np.int64) for n in (256, 512, 513))
    cfg = PruningConfig(settings={"c": {"method": "cosine_drop", "n_remove": 1, "seq_len": 32, "calib_windows": 2}},
                        recovery=RecoveryConfig(losses=("csd",), steps=1, batch_size=2, seq_len=32, tokens=512))
    workdir = tmp_path / "work"
    folder = workdir / "models" / "pruned" / "raw" / "d32"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (workdir / "data").mkdir(parents=True)
    for name, tokens in (("train", train), ("val", val)):
        np.save(workdir / "data" / f"{name}.npy", tokens)
    data = ((data_ref(workdir, workdir / "data" / "train.npy", "raw"), "training"),
            (data_ref(workdir, workdir / "data" / "val.npy", "val"), "evaluation"))
    with tracked_run("prune", uri=uri, experiment="t") as parent:
        save = _saver(SaveConfig(rows=("*+csd+random",)), tok, str(folder), str(folder), str(workdir),
                      {"variant": "raw", "run": "d32"})
        rows, _ = prune_rows(model, settings=cfg.methods(), recovery=cfg.recovery, calib=calib, train=train, val=val,
                             seq_len=32, batch_size=4, eval_tokens=512,
                             base_row={"model": "d32", "variant": "raw", "run": "d32"},
                             log=_logger(parent.ref(), "d32", workdir, data), save=save)
    kept = [r for r in rows if r.get("model_path")]
    assert [(r["setting"], r["recovery_loss"]) for r in kept] == [("c", "csd")]  # "c" itself is not in save.rows
    row = kept[0]
    key = pruned_model_key("raw", "d32", "c+csd+random")
    assert key == "raw/d32/pruned/c+csd+random"
    models = find_models(uri, "t")
    assert list(models) == [key]  # one logged model: the dense and unkept rows have none
    client = mlflow.MlflowClient(uri)
    logged = client.get_logged_model(models[key])
    metrics = {m.key: m.value for m in logged.metrics}
    assert metrics == {"ppl": row["ppl"], "params": row["params"], "flops_per_token": row["flops_per_token"],
                       "removed_fraction": row["removed_fraction"]}
    run = client.get_run(logged.source_run_id)
    assert run.info.run_name == "prune:d32:c+csd+random" and run.data.params["model_path"] == row["model_path"]
    # every row's run names the text it was trained, calibrated, recovered and scored on
    exp_id = client.get_experiment_by_name("t").experiment_id
    for r in client.search_runs([exp_id], "tags.`scalelab.stage` = 'prune'"):
        inputs = {(d.dataset.name, {t.key: t.value for t in d.tags}["mlflow.data.context"])
                  for d in r.inputs.dataset_inputs}
        assert inputs == {("raw", "training"), ("val", "evaluation")}, r.info.run_name
    assert logged.tags["scalelab.model_dir"] == str((workdir / row["model_path"]).resolve())
    # by reference: the store holds a few kB, not the weights
    store = Path(logged.artifact_location.removeprefix("file://"))
    assert sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) < 50_000
    assert not list(store.rglob("*.safetensors"))

    with _process_tracking_uri(uri):  # models:/ resolves through the process-wide store; restored after
        loaded = mlflow.pyfunc.load_model(f"models:/{models[key]}")
    ids = rng.integers(0, VOCAB, (2, 32)).astype(np.int64)
    got = loaded.predict(ids)
    pruned, _, _ = load_causal_lm(workdir / row["model_path"])
    assert pruned.config.num_hidden_layers == 2
    with torch.no_grad():
        want = pruned(torch.from_numpy(ids)).logits.float().numpy()
    assert got.shape == (2, 32, VOCAB)
    np.testing.assert_array_equal(got, want)
