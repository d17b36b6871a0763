"""Lineage in MLflow: which data a run read (by its DVC hash), which code and params made it, and
the models it produced, logged by reference.

* **Datasets.** :func:`data_ref` describes a Parquet or token file (or a folder of them) as the
  MLflow dataset ``name`` (the variant) with ``digest`` its DVC hash and ``source`` its DVC path
  (``data/tokens/raw.npy``, relative to the workdir). DVC 3 hashes a file as the md5 of its bytes,
  so the digest is the md5 of the content; where ``dvc.lock`` records the file (directly or in a
  folder output's ``.dir`` manifest in the DVC cache) and agrees, the profile says so
  (``"dvc_lock": "current"``) and names the output and its hash; a lock that disagrees is reported
  ``"stale"`` and the content hash is kept. :func:`log_datasets` attaches refs to a run with a
  context (``training``, ``evaluation``, ``output``).
* **Source.** The code and params that made a run are tagged by :mod:`tasks.common.provenance`.
* **Models.** :func:`log_model_ref` creates an MLflow 3 *logged model* whose artifacts are a pyfunc
  (``tasks/zoo/mlflow_model.py``) of a few kB that loads the safetensors from the workdir: the
  weights are not copied into the MLflow store. Its metrics carry the model id, so the Models tab
  compares them; :func:`register_alias` puts it in the Model Registry under an alias.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.common.config import flatten
from tasks.common.tracking import experiment_id, mlflow_client

# ---------------------------------------------------------------------------------------------
# Content and DVC hashes

_DIGESTS: dict[tuple[str, str, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def file_digest(path: str | Path, algorithm: str = "md5") -> str:
    """The hex ``hashlib`` digest of a file's bytes, computed once per process while the file's
    (resolved path, size, mtime) stay the same: stages hash the same outputs and models many times."""
    path = Path(path)
    st = path.stat()
    key = (algorithm, str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def file_md5(path: str | Path) -> str:
    """The md5 of a file's bytes (DVC 3's hash of a file output), cached by (path, size, mtime)."""
    return file_digest(path, "md5")


def folder_md5(path: str | Path) -> str:
    """A content hash of a folder: md5 over its files' relative paths and md5s, in path order."""
    path = Path(path)
    h = hashlib.md5()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{file_md5(f)}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class DvcEntry:
    """What ``dvc.lock`` records for a file: the output holding it and, when known, the file's own md5."""

    out: str          # the output's path as dvc.yaml names it (``data/curated``)
    out_md5: str      # its hash (``<md5>.dir`` for a folder)
    file_md5: str | None  # the file's md5 from the lock or the cached ``.dir`` manifest; None if unknown


def _read_lock(lock: Path) -> dict[str, str]:
    try:
        data = yaml.safe_load(lock.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{lock}: not valid YAML ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("stages", {}), dict):
        raise ValueError(f"{lock}: expected a mapping with `stages:` (a dvc.lock of DVC 2 or 3)")
    outs = {}
    for name, stage in (data.get("stages") or {}).items():
        for out in (stage or {}).get("outs") or []:
            if not isinstance(out, dict) or "path" not in out:
                raise ValueError(f"{lock}: stages.{name}.outs has an entry without `path`")
            if out.get("md5"):
                outs[str(out["path"]).rstrip("/")] = str(out["md5"])
    return outs


def dvc_entry(workdir: str | Path, rel: str | Path) -> DvcEntry | None:
    """The ``dvc.lock`` record (in ``workdir``) of the output holding ``rel`` (a path relative to
    ``workdir``), or None when there is no lock or no output holds it.

    A folder output's per-file md5s come from its ``.dir`` manifest in ``.dvc/cache/files/md5/``
    (DVC 3's cache layout) when the cache holds it.
    """
    workdir = Path(workdir)
    lock = workdir / "dvc.lock"
    if not lock.exists():
        return None
    outs = _read_lock(lock)
    rel = Path(rel).as_posix()
    for out, md5 in outs.items():
        if rel == out:
            return DvcEntry(out, md5, md5)
        if rel.startswith(out + "/"):
            inner = rel[len(out) + 1:]
            found = None
            if md5.endswith(".dir"):
                manifest = workdir / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
                if manifest.exists():
                    try:
                        entries = json.loads(manifest.read_text())
                    except json.JSONDecodeError:
                        raise ValueError(f"{manifest}: DVC's manifest of {out} is not valid JSON") from None
                    found = next((e.get("md5") for e in entries if e.get("relpath") == inner), None)
            return DvcEntry(out, md5, found)
    return None


# ---------------------------------------------------------------------------------------------
# Datasets


@dataclass(frozen=True)
class DataRef:
    """One dataset as MLflow records it: ``name`` (the variant), ``digest`` (DVC's md5 of the data),
    ``source`` (the DVC path relative to the workdir) and ``profile`` (sizes, the lock's view)."""

    name: str
    digest: str
    source: str
    profile: Mapping[str, Any] = field(default_factory=dict)


def _profile(path: Path) -> dict[str, Any]:
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    out: dict[str, Any] = {"bytes": path.stat().st_size}
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            out["rows"] = pq.read_metadata(path).num_rows
        elif path.suffix == ".npy":
            import numpy as np

            arr = np.load(path, mmap_mode="r")
            out["tokens"] = int(arr.size)
            out["dtype"] = str(arr.dtype)
    except Exception as exc:  # noqa: BLE001 — pyarrow and numpy raise their own types for a bad file
        raise ValueError(f"{path}: not a readable {path.suffix} file ({type(exc).__name__}: {exc})") from None
    return out


def data_ref(workdir: str | Path, path: str | Path, name: str, *, at: str | Path | None = None) -> DataRef:
    """Describe ``path`` (a file or folder under ``workdir``) as the dataset ``name``.

    ``at``: where the data will live once the stage ends, when ``path`` is a temporary copy (a stage
    writing into :func:`tasks.common.io.atomic_dir`); the source and the lock look-up use it.
    Raises ``FileNotFoundError`` naming the path when it does not exist.
    """
    workdir = Path(workdir).resolve()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such data to log as dataset {name!r}")
    final = Path(at) if at is not None else path
    final = final if final.is_absolute() else workdir / final
    try:
        rel = final.resolve().relative_to(workdir).as_posix()
    except ValueError:
        rel = str(final.resolve())  # outside the workdir: not a DVC output; the absolute path
    digest = folder_md5(path) if path.is_dir() else file_md5(path)
    profile = {"dvc_path": rel, "workdir": str(workdir), **_profile(path)}
    entry = dvc_entry(workdir, rel) if not path.is_dir() else None
    if entry is None:
        profile["dvc_lock"] = "none"
    else:
        profile |= {"dvc_out": entry.out, "dvc_out_md5": entry.out_md5}
        profile["dvc_lock"] = ("current" if entry.file_md5 == digest else
                               "unknown" if entry.file_md5 is None else "stale")
    return DataRef(name=name, digest=digest, source=rel, profile=profile)


def dataset_input(ref: DataRef, context: str):
    """The MLflow ``DatasetInput`` of ``ref`` under ``context`` (``training``, ``evaluation``, ``output``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    ds = Dataset(name=ref.name, digest=ref.digest[:36], source_type="local",
                 source=json.dumps({"uri": ref.source}), profile=json.dumps(dict(ref.profile), default=str))
    return DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])


_INPUTS_LOCK = threading.Lock()


def log_datasets(run: Any, refs: Iterable[DataRef] | None, context: str, *, attempts: int = 5) -> None:
    """Attach ``refs`` to ``run`` (a :class:`~tasks.common.tracking.TrackedRun`) as inputs under ``context``.

    MLflow's SQL store inserts a dataset row the first time a (name, digest) is logged; two runs
    logging the same new dataset at once (the training points of one variant, in parallel) race
    on that insert and one gets a UNIQUE-constraint error. Calls in this process are serialised;
    a race with another process is retried (the row exists by then)."""
    refs = list(refs or [])
    if not refs:
        return
    from mlflow.exceptions import MlflowException

    datasets = [dataset_input(r, context) for r in refs]
    for attempt in range(attempts):
        try:
            with _INPUTS_LOCK:
                mlflow_client(run.uri).log_inputs(run.run_id, datasets=datasets)
            return
        except MlflowException as exc:
            if "UNIQUE constraint" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


# ---------------------------------------------------------------------------------------------
# Models, logged by reference

MODEL_KEY = "scalelab.model_key"
# The pyfunc's code file, logged with each model as text (MLflow "models from code"), never imported here.
MODEL_CODE = Path(__file__).resolve().parents[1] / "zoo" / "mlflow_model.py"
_TEMPLATE: dict[str, Path] = {}
_TEMPLATE_LOCK = threading.Lock()


def _pyfunc_template() -> Path:
    """A pyfunc model folder made once per process; each logged model copies it and sets its own
    ``model_config`` (saving a pyfunc from scratch costs ~0.2 s, a copy ~5 ms)."""
    with _TEMPLATE_LOCK:
        if "dir" not in _TEMPLATE or not _TEMPLATE["dir"].exists():
            import mlflow.pyfunc

            from importlib.metadata import version

            out = Path(tempfile.mkdtemp(prefix="scalelab-pyfunc-")) / "model"
            reqs = [f"mlflow=={version('mlflow')}", f"torch=={version('torch')}", f"safetensors=={version('safetensors')}",
                    f"transformers=={version('transformers')}", "scalelab"]
            with warnings.catch_warnings():  # predict takes token ids or a frame of them: no type-hint schema
                warnings.filterwarnings("ignore", message=".*type hints.*")
                mlflow.pyfunc.save_model(str(out), python_model=str(MODEL_CODE), model_config={"kind": "template"},
                                         pip_requirements=reqs)
            _TEMPLATE["dir"] = out
        return _TEMPLATE["dir"]


def model_name(*parts: str) -> str:
    """A logged model's name from its parts: MLflow refuses ``/ : . % " '`` in it."""
    name = "-".join(str(p) for p in parts if p)
    for c in "/:.%\"' ":
        name = name.replace(c, "_")
    return name


def log_model_ref(
    run: Any,
    name: str,
    loader: Mapping[str, Any],
    *,
    key: str,
    metrics: Mapping[str, float | None] | None = None,
    params: Mapping[str, Any] | None = None,
    model_type: str = "scalelab",
    dataset: DataRef | None = None,
) -> str:
    """Log the model ``loader`` describes as an MLflow logged model, output of ``run``; return its id.

    ``loader`` is the pyfunc's ``model_config`` (:mod:`tasks.zoo.mlflow_model`): ``{"kind":
    "trained", "model_dir": ...}``, ``{"kind": "compressed", "file": ..., "base_dir": ...,
    "bits": ...}`` or ``{"kind": "pruned", "model_dir": ...}`` with absolute paths. The weights stay where they are (a few kB are logged).
    ``metrics`` are logged on ``run`` with the model's id (and ``dataset``'s name and digest, the
    data they were measured on), so the Models tab shows them; ``key`` (``raw/d16_l1-t8192``) is
    tagged ``scalelab.model_key`` for :func:`find_models`.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    client = mlflow_client(run.uri)
    exp_id = experiment_id(client, run.experiment, run.uri)
    model = client.create_logged_model(
        exp_id, name=model_name(name), source_run_id=run.run_id, model_type=model_type,
        tags={MODEL_KEY: key, **{f"scalelab.{k}": str(v) for k, v in loader.items() if k != "kind"}},
        params={k: str(v) for k, v in flatten(params or {}).items() if v is not None})
    try:
        with tempfile.TemporaryDirectory(prefix="scalelab-model-") as tmp:
            folder = Path(tmp) / "model"
            shutil.copytree(_pyfunc_template(), folder)
            mlmodel = folder / "MLmodel"
            spec = yaml.safe_load(mlmodel.read_text())
            spec["flavors"]["python_function"]["config"] = dict(loader)  # what load_context sees as model_config
            spec["model_id"] = model.model_id
            spec["run_id"] = run.run_id
            mlmodel.write_text(yaml.safe_dump(spec, sort_keys=False))
            client.log_model_artifacts(model.model_id, str(folder))
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    except BaseException:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    client.log_outputs(run.run_id, [LoggedModelOutput(model.model_id, 0)])
    if metrics:
        link_metrics(run, model.model_id, metrics, dataset=dataset)
    return model.model_id


def link_metrics(run: Any, model_id: str, metrics: Mapping[str, float | None], *,
                 dataset: DataRef | None = None) -> None:
    """Log finite ``metrics`` on ``run`` attached to the logged model ``model_id`` (missing stays missing)."""
    import math

    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    items = [Metric(k, float(v), ts, 0, model_id=model_id, run_id=run.run_id,
                    dataset_name=dataset.name if dataset else None,
                    dataset_digest=dataset.digest[:36] if dataset else None)
             for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
    if items:
        mlflow_client(run.uri).log_batch(run.run_id, metrics=items)


def find_models(uri: str, experiment: str) -> dict[str, str]:
    """``{scalelab.model_key: model_id}`` of the READY logged models of ``experiment`` (the newest per key)."""
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    found: dict[str, tuple[int, str]] = {}
    token = None
    while True:
        page = client.search_logged_models([exp.experiment_id], max_results=1000, page_token=token)
        for m in page:
            key = (m.tags or {}).get(MODEL_KEY)
            if key and str(m.status).endswith("READY") and (key not in found or m.creation_timestamp > found[key][0]):
                found[key] = (m.creation_timestamp, m.model_id)
        token = page.token
        if not token:
            break
    return {k: v for k, (_, v) in found.items()}


def budget_label(x: float) -> str:
    """A budget as an alias part MLflow accepts (letters, digits, ``_``, ``-``): 1e13 -> ``1e13``,
    3e11 -> ``3e11``, 8192 -> ``8192``, 2.5e8 -> ``2_5e8``."""
    x = float(x)
    if x.is_integer() and abs(x) < 1e5:
        return str(int(x))
    mantissa, exp = f"{x:.6e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".").replace(".", "_").replace("-", "m")
    return f"{mantissa}e{int(exp)}"


@contextlib.contextmanager
def _process_tracking_uri(uri: str) -> Iterator[None]:
    """Set MLflow's process-wide tracking URI to ``uri`` for the block, then restore both it and
    ``$MLFLOW_TRACKING_URI`` (``mlflow.set_tracking_uri`` writes the variable, and setting it back to
    "unset" would delete a user's own)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    saved_global, saved_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_global)
        if saved_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


def register_alias(uri: str, name: str, model_id: str, alias: str, *, run_id: str | None = None,
                   tags: Mapping[str, str] | None = None) -> str:
    """Register the logged model ``model_id`` as a new version of ``name`` and point ``alias`` at it;
    returns the version. The registered model is created when missing."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    # The version links to the logged model only through a models:/<id> source, which MLflow's store
    # resolves with a fresh client on the process-wide tracking URI (mlflow 3.x): point that at ``uri``
    # for the call (registration runs in the flow's own thread).
    with _process_tracking_uri(uri):
        version = client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
                                              tags=dict(tags or {}))
    client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)
