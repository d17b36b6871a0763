"""The README as a test: every command a user is told to run works as written, on a fresh copy.

The repository's files (``git ls-files``: tracked and new, uncommitted edits included, as a clone
of this working tree would hold them) are copied to a new folder that becomes its own git
repository, and each command of each ```bash block of README.md and of every Markdown page under
docs/ (by path) runs there in the order the text gives, through ``bash``, with only these substitutions:

* ``--preset demo`` and ``--preset full`` become ``--preset ci``, and the copy's
  ``params/pipeline.yaml`` defaults to ``ci``, so ``make demo``, ``dvc repro`` and
  ``scalelab run train`` run the ci pipeline;
* the copy's ``.venv`` is a link to this checkout's, so ``make venv`` finds it installed (CI's
  fresh clone is what tests the install itself), and ``PYTHONPATH`` puts the copy's code first;
* ``PATH`` does not hold ``.venv/bin`` (a user's fresh shell does not), ``HOME`` is a new folder.

A command whose comment says ``# needs ...`` (a cloud account, a Ray cluster) is one these machines
cannot run: it is skipped with that reason. Every other command must match one entry of
:data:`CHECKS`, which runs it and checks what the text promises (the files it lists, ``dvc repro``
skipping when nothing changed, a server answering); a command the README gains without an entry
fails :func:`test_every_command_is_checked_or_says_what_it_needs`, so the text and the program
cannot drift apart unseen. The error the README quotes for a bad params key is reproduced and
compared word for word.

``make test`` runs the checks that need no pipeline; the sequence is marked slow and runs in
``.ci/run``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pytest

from tests.processes import stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 1800


# --- reading the documents ---------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    doc: str    # "README.md", "docs/pruning.md"
    line: int
    text: str   # the command as written, comment and trailing '&' removed
    comment: str = ""
    background: bool = False

    @property
    def needs(self) -> str | None:
        """What the machine must have that these lack, from a ``# needs ...`` comment."""
        return self.comment if self.comment.startswith("needs ") else None

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


_LINE = re.compile(r"^(?P<cmd>.*?)(?:\s+#\s*(?P<comment>.*))?$")


def fenced_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """Every fenced block of a Markdown file: (info string, line of its first body line, body lines)."""
    blocks, info, start, body = [], None, 0, []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if info is None:
                info, start, body = line[3:].strip(), no + 1, []
            else:
                blocks.append((info, start, body))
                info = None
        elif info is not None:
            body.append(line)
    assert info is None, f"{path.name}: a fenced block opened on line {start - 1} is never closed"
    return blocks


def doc_commands(path: Path) -> list[Command]:
    """The commands of a document's ```bash blocks, in order (comment-only lines left out)."""
    out = []
    for info, start, body in fenced_blocks(path):
        if info not in ("bash", "sh", "shell"):
            continue
        for offset, raw in enumerate(body):
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            m = _LINE.match(raw.strip())
            cmd, comment = m["cmd"].strip(), (m["comment"] or "").strip()
            background = cmd.endswith("&")
            out.append(Command(str(path.relative_to(ROOT)), start + offset, cmd.rstrip("&").strip(), comment, background))
    return out


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in doc_commands(doc)]


def quoted_params_error() -> tuple[str, int, str]:
    """The bad-key error the README quotes: (params file, line, message before its '...')."""
    for info, _, body in fenced_blocks(ROOT / "README.md"):
        for line in body:
            m = re.match(r"scalelab: error: (params/\w+\.yaml):(\d+): (.*?)(?:\.\.\.)?$", line)
            if m:
                return m[1], int(m[2]), line.removesuffix("...")
    raise AssertionError("README.md quotes no 'scalelab: error: params/...' message")


def promised_outputs() -> list[str]:
    """What the README says ``make demo`` leaves: the backticked paths of its "It leaves" list."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("It leaves:", 1)[1].lstrip().split("\n\n", 1)[0]
    paths = []
    for item in re.split(r"\n- ", "\n" + block.strip())[1:]:
        names = re.findall(r"`([^`]+)`", item)
        head, rest = names[0], names[1:]
        inside = head.endswith("/") and item.split("`", 2)[2].lstrip().startswith("—")
        if inside:  # "- `reports/` — `a.json`, `plots/*.png`": paths inside it
            paths += [head + n for n in rest if not n.startswith(("id", "reason", "duplicate_of"))]
        else:
            paths += [n for n in names if "/" in n or "." in n]
    assert paths, "README.md: the 'It leaves:' list names no file"
    return paths


# --- running them ------------------------------------------------------------------------------

@dataclass
class Shell:
    """A user's shell in the fresh copy: exported variables persist, background jobs are stopped at the end."""

    cwd: Path
    env: dict[str, str]
    jobs: list[subprocess.Popen] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def run(self, cmd: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-c", cmd], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
        self.log.append(f"$ {cmd}\n[exit {done.returncode}]\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def ok(self, cmd: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        done = self.run(cmd, timeout)
        assert done.returncode == 0, f"`{cmd}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def start(self, cmd: str) -> subprocess.Popen:
        log_path = self.cwd / f".job{len(self.jobs)}.log"
        with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(["bash", "-c", cmd], cwd=self.cwd, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.jobs.append(proc)
        return proc

    def output(self, proc: subprocess.Popen) -> str:
        return proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]

    def wait_for(self, proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, f"{what}: the command ended ({proc.returncode}) before it was up:\n{self.output(proc)[-3000:]}"
            assert time.monotonic() < deadline, f"{what}: not up after {timeout} s:\n{self.output(proc)[-3000:]}"
            time.sleep(1)

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM the job and every process under it (infra/mlflow-ui.sh starts its own session), then SIGKILL."""
        stop_process_tree(proc)

    def close(self) -> None:
        for proc in self.jobs:
            self.stop(proc)


def option(cmd: Command, name: str) -> str:
    """The value the command gives option ``name`` (``--out evals/`` -> ``evals/``)."""
    words = shlex.split(cmd.text)
    return words[words.index(name) + 1]


def substituted(cmd: Command) -> str:
    return re.sub(r"--preset (demo|full)\b", "--preset ci", cmd.text)


def fresh_copy(dst: Path) -> Path:
    """The repository's files as a clone of this working tree would hold them, as a new git repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is not copied
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    # `make` reinstalls when pyproject.toml or the Makefile changed (its stamp is their hash); in the copy
    # that would point this checkout's editable install at the copy, so the stamp must be current.
    stamp = hashlib.sha256((dst / "pyproject.toml").read_bytes() + (dst / "Makefile").read_bytes()).hexdigest()[:12]
    assert (VENV / f".installed-{stamp}").exists(), f"{VENV} is not installed for this pyproject.toml/Makefile: run `make venv`"
    (dst / ".venv").symlink_to(VENV)
    pipeline = dst / "params" / "pipeline.yaml"
    text, n = re.subn(r"(?m)^(\s+preset:\s*)demo\b", r"\1ci", pipeline.read_text())
    assert n == 1, "params/pipeline.yaml: no `preset: demo` line to switch to ci"
    pipeline.write_text(text)
    git = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fresh copy"]):
        subprocess.run(["git", *args], cwd=dst, env=git, check=True, capture_output=True)
    return dst


def user_env(copy: Path, home: Path) -> dict[str, str]:
    """The environment of a user's new shell in ``copy``: no test settings, no venv on PATH."""
    venv_bin = str(VENV / "bin")
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p) != Path(venv_bin))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "SCALELAB_", "PYTEST_", "VIRTUAL_ENV", "TRITON_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(PATH=path, HOME=str(home), PYTHONPATH=str(copy), DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t",
               GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return env


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def answers(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False
    return ready


# --- what each command promises ------------------------------------------------------------------

def check_make_demo(sh: Shell, cmd: Command) -> None:
    sh.ok(substituted(cmd))
    missing = []
    for rel in promised_outputs():
        hits = list(sh.cwd.glob(rel)) if "*" in rel else [sh.cwd / rel] if (sh.cwd / rel).exists() else []
        if not hits:
            missing.append(rel)
    assert not missing, f"{cmd}: the README says it leaves {missing}, which are not there"
    status = sh.ok(".venv/bin/dvc status")
    assert "up to date" in status.stdout, status.stdout


def check_mlflow_ui(sh: Shell, cmd: Command) -> None:
    assert port_free(5000), "port 5000 is in use: the README's `make ui` cannot start here"
    proc = sh.start(substituted(cmd))
    try:
        sh.wait_for(proc, answers("http://127.0.0.1:5000/health"), str(cmd))
        with urllib.request.urlopen("http://127.0.0.1:5000/", timeout=10) as resp:
            assert "MLflow" in resp.read().decode(errors="replace")
    finally:
        sh.stop(proc)


def check_dvc_metrics(sh: Shell, cmd: Command) -> None:
    out = sh.ok(substituted(cmd)).stdout
    assert "reports/" in out, out[-2000:]


def check_dvc_plots(sh: Shell, cmd: Command) -> None:
    sh.ok(substituted(cmd))
    page = (sh.cwd / "dvc_plots" / "index.html").read_text(encoding="utf-8")
    # "offline": the template .dvc/config names inlines Vega; no script comes from the network
    assert "vegaEmbed(" in page and not re.search(r"<script[^>]*\ssrc=", page), "dvc plots show's page loads scripts"


def check_report(sh: Shell, cmd: Command) -> None:
    out = sh.ok(substituted(cmd)).stdout
    assert "What this run found" in out and "Scaling laws" in out, out[-2000:]
    assert "Scaling laws" in (sh.cwd / "reports" / "summary.md").read_text(encoding="utf-8")


def check_eval_tasks(sh: Shell, cmd: Command) -> None:
    sh.ok(substituted(cmd))
    out = sh.cwd / option(cmd, "--out")
    summary = pl.read_csv(out / "summary.csv")
    asked = option(cmd, "--tasks").split(",")
    assert sorted(summary["task"]) == sorted(asked), summary
    assert (out / "items.parquet").exists()


def check_run_all(sh: Shell, cmd: Command) -> None:
    workdir = sh.cwd
    if "--workdir" in cmd.text:  # a nested folder that does not exist yet, made by the command
        workdir = (sh.cwd / option(cmd, "--workdir")).resolve()
        assert not workdir.parent.exists(), f"{cmd}: {workdir.parent} exists before the command ran"
    done = sh.ok(substituted(cmd))
    if "--workdir" in cmd.text:
        assert f"scalelab: workdir {workdir}" in done.stdout, done.stdout[-2000:]
    for name in ("train.csv", "compress.csv", "sparse_eval.csv", "downstream.csv", "fits.json"):
        assert (workdir / "reports" / name).exists(), f"{cmd}: no reports/{name} in {workdir}"


def check_plan(sh: Shell, cmd: Command) -> None:
    out = sh.ok(substituted(cmd)).stdout
    assert "Training plan" in out and "Per series" in out, out[-2000:]


def check_run_stage(sh: Shell, cmd: Command) -> None:
    report = sh.cwd / "reports" / f"{shlex.split(cmd.text)[2]}.csv"
    before = report.stat().st_mtime_ns if report.exists() else None
    sh.ok(substituted(cmd))
    assert report.exists() and report.stat().st_mtime_ns != before, f"{cmd}: {report.name} was not rewritten"


def check_dvc_repro(sh: Shell, cmd: Command) -> None:
    sh.ok(substituted(cmd))
    again = sh.ok(substituted(cmd))  # dvc.yaml: "a second `dvc repro` with nothing changed skips all"
    assert "Data and pipelines are up to date" in again.stdout + again.stderr, again.stdout[-3000:]


def check_dvc_exp(sh: Shell, cmd: Command) -> None:
    done = sh.ok(substituted(cmd))
    assert "Ran experiment" in done.stdout + done.stderr, done.stdout[-3000:]
    key, _, value = option(cmd, "-S").rpartition(":")[2].partition("=")
    shown = sh.ok(".venv/bin/dvc exp show --json").stdout
    assert key.rsplit(".", 1)[-1] in shown and value in shown, shown[-3000:]


def check_params_ok(sh: Shell, cmd: Command) -> None:
    assert "params OK" in sh.ok(substituted(cmd)).stdout


def check_curate(sh: Shell, cmd: Command) -> None:
    """A user's corpus: the prepared split's first documents, one exact duplicate, one broken line."""
    src, out = sh.cwd / option(cmd, "--input"), sh.cwd / option(cmd, "--out")
    docs = pl.read_parquet(sh.cwd / "data" / "prepared" / "train" / "*.parquet").head(300).select("id", "text")
    lines = [json.dumps(r) for r in docs.to_dicts()]
    lines += [json.dumps({"id": "copy-of-first", "text": docs["text"][0]}), '{"id": "broken", "text": ']
    src.write_text("\n".join(lines) + "\n")
    sh.ok(substituted(cmd))
    for name in ("kept.parquet", "dropped.parquet", "quarantine.parquet", "stats.json"):
        assert (out / name).exists(), f"{cmd}: the README says it writes {name}"
    dropped = pl.read_parquet(out / "dropped.parquet")
    assert {"id", "reason", "duplicate_of"} <= set(dropped.columns)
    assert "copy-of-first" in dropped["id"].to_list() or docs["id"][0] in dropped["id"].to_list()
    quarantine = pl.read_parquet(out / "quarantine.parquet")
    assert quarantine["line"].to_list() == [len(lines)], quarantine


def check_prune(sh: Shell, cmd: Command) -> None:
    sh.ok(substituted(cmd))
    out = sh.cwd / option(cmd, "--out")
    record = json.loads((out / "scalelab.json").read_text())
    assert record["params_after"] < record["params_before"] and record["ppl_after"] > 0, record
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists(), sorted(p.name for p in out.iterdir())


def check_distill(sh: Shell, cmd: Command) -> None:
    student = sh.cwd / option(cmd, "--student")
    before = json.loads((student / "scalelab.json").read_text())["ppl_after"]
    sh.ok(substituted(cmd))
    record = json.loads((sh.cwd / option(cmd, "--out") / "scalelab.json").read_text())
    # the student as the prune command left it, scored again before recovery
    assert record["ppl_before"] == pytest.approx(before, rel=1e-3) and record["ppl_after"] > 0, record


def check_work_pool(sh: Shell, cmd: Command) -> None:
    assert "Created work pool" in sh.ok(substituted(cmd)).stdout


def check_export(sh: Shell, cmd: Command) -> None:
    name, _, value = cmd.text.removeprefix("export ").partition("=")
    sh.env[name] = value


def check_prefect_server(sh: Shell, cmd: Command) -> None:
    assert cmd.background, f"{cmd}: the README runs the server in the background (&) before deploying"
    assert port_free(4200), "port 4200 is in use: the README's Prefect server cannot start here"
    proc = sh.start(substituted(cmd))  # left running for the commands after it; stopped at the end
    sh.wait_for(proc, answers("http://127.0.0.1:4200/api/health"), str(cmd))


def check_prefect_deploy(sh: Shell, cmd: Command) -> None:
    out = sh.ok(substituted(cmd)).stdout
    listed = sh.ok(".venv/bin/prefect deployment ls").stdout
    for name in re.findall(r"(?m)^  - name: (\S+)", (sh.cwd / "infra" / "prefect.yaml").read_text()):
        assert name in listed, f"{cmd}: deployment {name} not on the server:\n{out[-2000:]}\n{listed}"


def check_serve(sh: Shell, cmd: Command) -> None:
    proc = sh.start(substituted(cmd))
    try:
        sh.wait_for(proc, lambda: "being served" in sh.output(proc), str(cmd))
        out = sh.output(proc)
        for name in ("nightly-ci", "weekly-demo", "refit"):
            assert name in out, f"{cmd}: the README says it serves {name}:\n{out[-2000:]}"
    finally:
        sh.stop(proc)


@dataclass(frozen=True)
class Check:
    pattern: str                           # re.fullmatch against the command as written
    run: Callable[[Shell, Command], None] | None
    why_not: str = ""                      # why the sequence does not run it (run is None)


CHECKS = [
    Check(r"make demo", check_make_demo),
    Check(r"make test", None, "the test suite itself: this test runs inside it"),
    Check(r"make ui", check_mlflow_ui),
    Check(r"\.venv/bin/dvc metrics show", check_dvc_metrics),
    Check(r"\.venv/bin/dvc plots show", check_dvc_plots),
    Check(r"\.venv/bin/scalelab report", check_report),
    Check(r"\.venv/bin/scalelab eval tasks .*", check_eval_tasks),
    Check(r"\.venv/bin/scalelab run all --preset \w+( --workdir \S+)?", check_run_all),
    Check(r"\.venv/bin/scalelab run (prepare|curate|train|compress|sparse_eval|evaluate|fit)", check_run_stage),
    Check(r"\.venv/bin/dvc repro", check_dvc_repro),
    Check(r"\.venv/bin/dvc exp run -S .*", check_dvc_exp),
    Check(r"\.venv/bin/scalelab check-params", check_params_ok),
    Check(r"\.venv/bin/scalelab plan --preset \w+", check_plan),
    Check(r"\.venv/bin/scalelab curate --input \S+ --out \S+ --recipe \S+", check_curate),
    Check(r"\.venv/bin/scalelab prune --model \S+ --method \S+( --set \S+)* --out \S+", check_prune),
    Check(r"\.venv/bin/scalelab distill --teacher \S+ --student \S+ .* --out \S+", check_distill),
    Check(r"\.venv/bin/scalelab serve", check_serve),
    Check(r"\.venv/bin/prefect server start .*", check_prefect_server),
    Check(r"\.venv/bin/prefect work-pool create .*", check_work_pool),
    Check(r"export PREFECT_API_URL=\S+", check_export),
    Check(r"\.venv/bin/prefect deploy .*", check_prefect_deploy),
]


def check_for(cmd: Command) -> Check | None:
    found = [c for c in CHECKS if re.fullmatch(c.pattern, cmd.text)]
    assert len(found) <= 1, f"{cmd}: matched by more than one check: {[c.pattern for c in found]}"
    return found[0] if found else None


# --- the tests ---------------------------------------------------------------------------------

def test_every_command_is_checked_or_says_what_it_needs():
    commands = all_commands()
    assert len(commands) >= 10, [str(c) for c in commands]
    unchecked = [str(c) for c in commands if check_for(c) is None and not c.needs]
    assert not unchecked, ("these commands have no check in tests/docs/test_readme.py CHECKS and no "
                           "`# needs ...` comment saying what they need: " + "; ".join(unchecked))
    needing = [c for c in commands if c.needs]
    assert needing and all(check_for(c) is None for c in needing)
    # what these machines lack is said in the text itself
    assert any("ray up" in c.text for c in needing)


def test_the_readme_quotes_the_error_a_bad_params_key_gets(tmp_path: Path):
    """Rename the key on the quoted line to the quoted key; `scalelab run` must print the quoted words."""
    rel, line_no, quoted = quoted_params_error()
    m = re.search(r": (\w+)\.(\w+): unknown key '(\w+)'", quoted)
    assert m, quoted
    shutil.copytree(ROOT / "params", tmp_path / "params")
    lines = (tmp_path / rel).read_text().splitlines(keepends=True)
    key = re.match(r"^  (\w+):", lines[line_no - 1])
    assert key, f"README.md quotes {rel}:{line_no}, which holds no key of the {m[1]} section: {lines[line_no - 1]!r}"
    lines[line_no - 1] = lines[line_no - 1].replace(f"{key[1]}:", f"{m[3]}:", 1)
    (tmp_path / rel).write_text("".join(lines))
    done = subprocess.run([str(VENV / "bin" / "scalelab"), "run", "train", "--preset", "ci", "--workdir", "wd"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(quoted), f"README.md quotes:\n{quoted}\nscalelab printed:\n{done.stderr[:600]}"
    assert not (tmp_path / "wd").exists(), "a bad key must stop the command before the workdir is made"


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    base = tmp_path_factory.mktemp("readme")
    copy = fresh_copy(base / "repo")
    sh = Shell(copy, user_env(copy, base / "home"))
    yield sh
    sh.close()


@pytest.mark.slow
@pytest.mark.parametrize("cmd", all_commands(), ids=str)
def test_readme_command_runs_as_written(cmd: Command, shell: Shell):
    if cmd.needs:
        pytest.skip(f"{cmd}: {cmd.needs}")
    check = check_for(cmd)
    assert check is not None, f"{cmd}: no check (see test_every_command_is_checked_or_says_what_it_needs)"
    if check.run is None:
        pytest.skip(check.why_not)
    check.run(shell, cmd)
