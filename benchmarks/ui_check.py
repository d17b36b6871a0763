"""Look at a finished workdir's MLflow UI as a user would: are the Datasets and Models views filled?

Run: .venv/bin/python benchmarks/ui_check.py [--workdir DIR] [--out docs] [--port N]

Starts the MLflow UI (infra/mlflow-ui.sh, the script behind ``make ui``) on 127.0.0.1 over a copy of
``<workdir>/mlflow.db`` (the UI may migrate or write its store; the workdir is left as it was), then
checks two things for each view:

* through MLflow's REST API: runs of the ``scalelab`` experiment that record dataset inputs, and
  logged models (with their metrics) and registry aliases;
* in headless Chromium (Debian's ``chromium`` package): the page as rendered (its DOM after the
  scripts ran) names those datasets and models, and a screenshot is saved to ``--out``
  (``mlflow_runs_datasets.png``, ``mlflow_models.png``).

Exits non-zero, saying which view is empty, when a check fails. Chromium missing: installed with
``apt-get install -y chromium`` when running as root with apt (said so on stderr), else an error
naming the package. Default workdir: the repository root, where ``make demo`` leaves mlflow.db.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "scalelab"
MAX_PNG_BYTES = 300_000
WINDOW = (1600, 1000)
# The UI's "Model training" layout (its default, "GenAI", lists logged models as "Agent versions").
WORKFLOW = "machine_learning"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_binary(install: bool) -> str:
    """Debian's ``chromium``; installed with apt when missing and allowed (root, apt-get present)."""
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    apt = shutil.which("apt-get")
    if install and apt and os.geteuid() == 0:
        print("ui_check: chromium is missing; installing Debian's package: apt-get install -y chromium",
              file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        done = subprocess.run([apt, "install", "-y", "chromium"], env=env, capture_output=True, text=True)
        if done.returncode != 0:  # a stale package list is the usual cause
            subprocess.run([apt, "update"], env=env, capture_output=True)
            done = subprocess.run([apt, "install", "-y", "chromium"], env=env, capture_output=True, text=True)
        if found := shutil.which("chromium"):
            return found
        sys.exit(f"ui_check: could not install chromium (apt-get exited {done.returncode}):\n{done.stderr[-2000:]}")
    sys.exit("ui_check: needs a headless browser: Debian's `chromium` package is not installed "
             "(as root: apt-get install -y chromium; or pass a browser with --chromium PATH)")


def copy_store(db: Path, dst: Path) -> Path:
    """A consistent copy of the sqlite store (sqlite's backup API: safe while a run still writes)."""
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out = sqlite3.connect(dst)
    with out:
        src.backup(out)
    src.close()
    out.close()
    return dst


class MlflowUI:
    """``infra/mlflow-ui.sh PORT`` over ``uri``; the script puts the server in its own process group
    (``setsid``), so one signal to that group stops the server and its worker."""

    def __init__(self, uri: str, port: int, log: Path):
        env = dict(os.environ, MLFLOW_TRACKING_URI=uri, VENV=str(Path(sys.executable).parent.parent))
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        with open(log, "w") as out:  # not a session leader itself: `setsid` then keeps this pid
            self.proc = subprocess.Popen(["bash", str(ROOT / "infra" / "mlflow-ui.sh"), str(port)], env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"ui_check: the MLflow UI did not come up:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(1)

    def api(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base}/api/2.0/mlflow/{path}", data=data,
                                     headers={"Content-Type": "application/json"}, method="POST" if data else "GET")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def search_all(ui: MlflowUI, path: str, body: dict, key: str) -> list[dict]:
    """Every page of a search endpoint (runs/search, logged-models/search)."""
    out, token = [], None
    while True:
        page = ui.api(path, body | ({"page_token": token} if token else {}))
        out += page.get(key, [])
        token = page.get("next_page_token")
        if not token:
            return out


def render(chromium: str, url: str, shot: Path | None, profile: Path, budget_ms: int) -> str:
    """The page's DOM after ``budget_ms`` of virtual time (scripts and fetches ran); with ``shot``,
    also its screenshot at :data:`WINDOW`."""
    args = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--virtual-time-budget={budget_ms}"]
    dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    if dom.returncode != 0 or not dom.stdout:
        sys.exit(f"ui_check: chromium could not render {url} (exit {dom.returncode}):\n{dom.stderr[-2000:]}")
    if shot is not None:
        done = subprocess.run([*args, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=180)
        if done.returncode != 0 or not shot.exists():
            sys.exit(f"ui_check: chromium took no screenshot of {url}:\n{done.stderr[-2000:]}")
        shrink(shot)
    return dom.stdout


def page_text(dom: str) -> str:
    text = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", dom)
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


def shrink(png: Path) -> None:
    """Keep a committed screenshot under :data:`MAX_PNG_BYTES`: a 256-colour palette PNG (a UI
    screenshot has few colours; text stays sharp)."""
    if png.stat().st_size <= MAX_PNG_BYTES:
        return
    from PIL import Image

    with Image.open(png) as img:
        small = img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT, help="a finished workdir holding mlflow.db")
    ap.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the screenshots")
    ap.add_argument("--port", type=int, default=0, help="MLflow UI port (default: a free one)")
    ap.add_argument("--chromium", default=None, help="browser binary (default: Debian's chromium)")
    ap.add_argument("--no-install", action="store_true", help="fail instead of apt-installing chromium")
    ap.add_argument("--budget-ms", type=int, default=25_000, help="virtual time each page gets to render")
    args = ap.parse_args()

    db = args.workdir.resolve() / "mlflow.db"
    if not db.is_file():
        sys.exit(f"ui_check: no MLflow store at {db}: run `make demo` (or `scalelab run all --workdir DIR`) first")
    chromium = args.chromium or chromium_binary(install=not args.no_install)
    if shutil.which(chromium) is None:
        sys.exit(f"ui_check: --chromium {chromium}: no such executable")
    args.out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="scalelab-ui-check-") as tmp:
        tmp = Path(tmp)
        uri = f"sqlite:///{copy_store(db, tmp / 'mlflow.db')}"
        ui = MlflowUI(uri, args.port or free_port(), tmp / "mlflow-ui.log")
        try:
            ui.wait()
            exp = ui.api(f"experiments/get-by-name?experiment_name={EXPERIMENT}")["experiment"]
            exp_id = exp["experiment_id"]

            # --- Datasets: runs that record what data they read or wrote
            runs = search_all(ui, "runs/search", {"experiment_ids": [exp_id], "max_results": 1000}, "runs")
            with_data = [r for r in runs if (r.get("inputs") or {}).get("dataset_inputs")]
            names = sorted({d["dataset"]["name"] for r in with_data for d in r["inputs"]["dataset_inputs"]})
            digests = {d["dataset"]["digest"] for r in with_data for d in r["inputs"]["dataset_inputs"]}
            print(f"REST: {len(runs)} runs in experiment {EXPERIMENT!r} ({exp_id}); {len(with_data)} record "
                  f"dataset inputs: {len(names)} datasets ({', '.join(names[:8])}{' ...' if len(names) > 8 else ''}), "
                  f"{len(digests)} digests")
            if not with_data:
                failures.append("REST: no run of the experiment records a dataset input")
            train_runs = [r for r in with_data
                          if any(t["key"] == "scalelab.stage" and t["value"] == "train" for t in r["data"].get("tags", []))]
            shown = train_runs or with_data
            # Sorted by anything but start time, the runs table lists child runs flat (by start time it
            # folds them under the pipeline run, filter or not).
            query = {"workflowType": WORKFLOW, "orderByKey": "tags.`mlflow.runName`", "orderByAsc": "true"}
            if train_runs:
                query["searchFilter"] = "tags.`scalelab.stage` = 'train'"
            url = f"{ui.base}/#/experiments/{exp_id}/runs?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"
            dom = page_text(render(chromium, url, args.out / "mlflow_runs_datasets.png", tmp / "chrome", args.budget_ms))
            run_names = {r["info"]["run_name"] for r in shown}
            seen_runs = sorted(n for n in run_names if n in dom)
            seen_data = sorted(n for n in names if re.search(rf"\b{re.escape(n)}\b", dom))
            print(f"page {url}: {len(seen_runs)} of {len(run_names)} run names shown, datasets named: {seen_data}")
            if not seen_runs or not seen_data:
                failures.append(f"runs page: rendered without {'runs' if not seen_runs else 'dataset names'}")

            # --- Models: logged models (with metrics) and registry aliases
            models = search_all(ui, "logged-models/search", {"experiment_ids": [exp_id], "max_results": 100}, "models")
            with_metrics = [m for m in models if (m.get("data") or {}).get("metrics")]
            registered = ui.api("registered-models/search?max_results=1000").get("registered_models", [])
            aliases = sorted(f"{m['name']}@{a['alias']}" for m in registered for a in m.get("aliases", []))
            print(f"REST: {len(models)} logged models ({len(with_metrics)} with metrics), "
                  f"{len(registered)} registered models, aliases: {', '.join(aliases) or 'none'}")
            if not models:
                failures.append("REST: no logged model in the experiment")
            url = f"{ui.base}/#/experiments/{exp_id}/models?workflowType={WORKFLOW}"
            dom = page_text(render(chromium, url, args.out / "mlflow_models.png", tmp / "chrome", args.budget_ms))
            model_names = {m["info"]["name"] for m in models}
            seen_models = sorted(n for n in model_names if n in dom)
            print(f"page {url}: {len(seen_models)} of {len(model_names)} model names shown")
            if not seen_models:
                failures.append("models page: rendered without any logged model")
        finally:
            ui.stop()
    for png in ("mlflow_runs_datasets.png", "mlflow_models.png"):
        if (args.out / png).exists():
            print(f"screenshot: {args.out / png} ({(args.out / png).stat().st_size / 1e3:.0f} kB)")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
