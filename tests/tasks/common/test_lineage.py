"""Lineage helpers: dataset digests against dvc.lock, inherited source tags, models logged by reference and
registered, loaded back through MLflow with the folder's logits."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import yaml

from tasks.common.lineage import (
    budget_label, data_ref, dvc_entry, find_models, log_datasets, log_model_ref, model_name, register_alias,
)
from tasks.common.provenance import PARAMS_HASH
from tasks.common.tracking import tracked_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_fixtures import markov_tokens, tiny_config  # noqa: E402


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _parquet_bytes(texts: list[str]) -> bytes:
    import io

    import polars as pl

    buf = io.BytesIO()
    pl.DataFrame({"text": texts}).write_parquet(buf)
    return buf.getvalue()


TOKENS_V1 = _npy_bytes(np.arange(9, dtype=np.uint16))
PARQUET_V1 = _parquet_bytes(["a", "b", "c"])


def _md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    """A workdir with a file output and a folder output recorded in dvc.lock (the folder's
    ``.dir`` manifest in DVC 3's cache layout)."""
    (tmp_path / "data" / "tokens").mkdir(parents=True)
    (tmp_path / "data" / "curated" / "raw").mkdir(parents=True)
    np.save(tmp_path / "data" / "tokens" / "raw.npy", np.arange(9, dtype=np.uint16))
    kept = tmp_path / "data" / "curated" / "raw" / "kept.parquet"
    kept.write_bytes(PARQUET_V1)
    manifest = json.dumps([{"md5": _md5(PARQUET_V1), "relpath": "raw/kept.parquet"}]).encode()
    dir_md5 = _md5(manifest) + ".dir"
    cache = tmp_path / ".dvc" / "cache" / "files" / "md5" / dir_md5[:2]
    cache.mkdir(parents=True)
    (cache / dir_md5[2:]).write_bytes(manifest)
    lock = {"schema": "2.0", "stages": {
        "curate": {"cmd": "x", "outs": [{"path": "data/curated", "hash": "md5", "md5": dir_md5, "nfiles": 1}]},
        "train": {"cmd": "y", "outs": [{"path": "data/tokens/raw.npy", "hash": "md5", "md5": _md5(TOKENS_V1),
                                        "size": len(TOKENS_V1)}]},
    }}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    return tmp_path


def test_digest_is_the_dvc_hash_of_a_file_output(workdir: Path):
    ref = data_ref(workdir, workdir / "data" / "tokens" / "raw.npy", "raw")
    assert ref.name == "raw" and ref.source == "data/tokens/raw.npy"
    assert ref.digest == _md5(TOKENS_V1) and ref.profile["dvc_lock"] == "current"
    assert ref.profile["tokens"] == 9
    assert ref.profile["dvc_out"] == "data/tokens/raw.npy"


def test_digest_of_a_file_inside_a_folder_output_comes_from_its_manifest(workdir: Path):
    entry = dvc_entry(workdir, "data/curated/raw/kept.parquet")
    assert entry is not None and entry.out == "data/curated" and entry.out_md5.endswith(".dir")
    assert entry.file_md5 == _md5(PARQUET_V1)
    ref = data_ref(workdir, workdir / "data" / "curated" / "raw" / "kept.parquet", "raw")
    assert ref.digest == entry.file_md5 and ref.profile["dvc_lock"] == "current"
    assert ref.profile["dvc_out_md5"] == entry.out_md5


def test_a_stale_lock_is_reported_and_the_content_hash_kept(workdir: Path):
    path = workdir / "data" / "tokens" / "raw.npy"
    np.save(path, np.arange(10, dtype=np.uint16))  # changed since dvc repro
    ref = data_ref(workdir, path, "raw")
    assert ref.digest == _md5(path.read_bytes()) != _md5(TOKENS_V1) and ref.profile["dvc_lock"] == "stale"


def test_without_a_lock_the_digest_is_the_content_hash(tmp_path: Path):
    import polars as pl

    pl.DataFrame({"text": ["a", "b"]}).write_parquet(tmp_path / "val.parquet")
    ref = data_ref(tmp_path, tmp_path / "val.parquet", "val")
    assert ref.digest == _md5((tmp_path / "val.parquet").read_bytes()) and ref.profile["dvc_lock"] == "none"
    assert ref.profile["rows"] == 2


def test_a_temporary_copy_is_logged_under_its_final_dvc_path(workdir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("atomic") / "kept.parquet"
    tmp.write_bytes(PARQUET_V1)
    ref = data_ref(workdir, tmp, "raw", at=workdir / "data" / "curated" / "raw" / "kept.parquet")
    assert ref.source == "data/curated/raw/kept.parquet" and ref.profile["dvc_lock"] == "current"


def test_bad_input_names_the_file(workdir: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        data_ref(workdir, workdir / "missing.npy", "raw")
    (workdir / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet"):
        data_ref(workdir, workdir / "broken.parquet", "raw")
    (workdir / "dvc.lock").write_text("stages: [unclosed")
    with pytest.raises(ValueError, match="dvc.lock"):
        dvc_entry(workdir, "data/tokens/raw.npy")


def test_children_inherit_source_tags_and_datasets_show_on_the_run(workdir: Path):
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    ref = data_ref(workdir, workdir / "data" / "tokens" / "raw.npy", "raw")
    with tracked_run("train", uri=uri, experiment="t", tags={PARAMS_HASH: "abc123"}) as parent:
        with tracked_run("train:raw:d16", uri=uri, experiment="t", parent=parent.ref()) as child:
            log_datasets(child, [ref], "training")
    run = mlflow.MlflowClient(uri).get_run(child.run_id)
    assert run.data.tags[PARAMS_HASH] == "abc123"
    (ds,) = run.inputs.dataset_inputs
    assert (ds.dataset.name, ds.dataset.digest) == ("raw", ref.digest)
    assert json.loads(ds.dataset.source)["uri"] == "data/tokens/raw.npy"
    assert {t.key: t.value for t in ds.tags}["mlflow.data.context"] == "training"


def test_aliases_and_model_names_are_what_mlflow_accepts():
    assert budget_label(1e13) == "1e13" and budget_label(3e11) == "3e11"
    assert budget_label(8192) == "8192" and budget_label(2.5e8) == "2_5e8"
    assert model_name("raw+repb", "d16_l1-t8192", "anybcq@w3") == "raw+repb-d16_l1-t8192-anybcq@w3"
    assert model_name("raw", "d1.5") == "raw-d1_5"


def test_registered_model_loads_back_with_the_folders_logits(tmp_path: Path):
    """Train a tiny model, log it by reference, register it under an alias, load it through
    ``models:/<name>@<alias>`` and compare logits with the folder's."""
    from tasks.training.loop import train_model
    from tasks.training.design import ladder
    from tasks.zoo.ladder import load_model

    cfg = tiny_config(token_budgets=(512,), eval_tokens=256)
    data = markov_tokens(6000)
    out = tmp_path / "models" / "raw" / "d32"
    result = train_model(ladder(cfg)[0], cfg, data[:5000], data[5000:], out)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with tracked_run("train:raw:d32", uri=uri, experiment="t") as run:
        model_id = log_model_ref(run, "raw-d32", {"kind": "trained", "model_dir": str(out.resolve())},
                                 key="raw/d32", metrics={"val_loss": result.val_loss, "ppl": None})
    env = os.environ.get("MLFLOW_TRACKING_URI")
    version = register_alias(uri, "raw", model_id, "best-512", run_id=run.run_id)
    client = mlflow.MlflowClient(uri)
    registered = client.get_model_version_by_alias("raw", "best-512")
    # linked to the logged model by its source (MLflow's SQL registry keeps no model_id column)
    assert str(registered.version) == version and registered.source == f"models:/{model_id}"
    assert mlflow.get_tracking_uri() != uri  # the process-wide URI was restored after registering
    assert os.environ.get("MLFLOW_TRACKING_URI") == env  # and the variable (the test session's own store)
    logged = client.get_logged_model(model_id)
    assert [m.key for m in logged.metrics] == ["val_loss"]  # ppl None: missing, not 0
    assert find_models(uri, "t") == {"raw/d32": model_id}
    # by reference: the store holds a few kB, not the weights
    store = Path(logged.artifact_location.removeprefix("file://"))
    assert sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) < 50_000
    assert not list(store.rglob("*.safetensors"))

    mlflow.set_tracking_uri(uri)  # registry look-ups go through the process-wide store; registering did not
    loaded = mlflow.pyfunc.load_model("models:/raw@best-512")
    ids = np.asarray(data[5000:5000 + 2 * 32].astype(np.int64)).reshape(2, 32)
    got = loaded.predict(ids)
    model, _ = load_model(out)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.float().numpy()
    assert got.shape == (2, 32, 256)
    np.testing.assert_array_equal(got, want)


def test_parallel_runs_log_the_same_new_dataset(tmp_path: Path):
    """The training points of one variant run in parallel and log the same (new) dataset at once."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "raw.npy", np.arange(64, dtype=np.uint16))
    ref = data_ref(tmp_path, tmp_path / "data" / "raw.npy", "raw")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with tracked_run("train", uri=uri, experiment="t") as parent, contextlib.ExitStack() as stack:
        runs = [stack.enter_context(tracked_run(f"train:raw:{i}", uri=uri, experiment="t", parent=parent.ref()))
                for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda r: log_datasets(r, [ref], "training"), runs))
    client = mlflow.MlflowClient(uri)
    for r in runs:
        inputs = client.get_run(r.run_id).inputs.dataset_inputs
        assert [d.dataset.name for d in inputs] == ["raw"]
