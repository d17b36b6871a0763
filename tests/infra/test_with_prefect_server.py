"""infra/with-prefect-server: the command runs against one Prefect server started for it, gets its
exit status back, and leaves no server behind; a PREFECT_API_URL already set is used as it is."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "infra" / "with-prefect-server"

needs_prefect = pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "prefect").exists(), reason="no .venv: make venv")


def servers() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "server" in (p.info["cmdline"] or []) and any("prefect" in a for a in p.info["cmdline"] or [])}


@needs_prefect
def test_the_command_runs_against_a_server_that_stops_with_it(tmp_path):
    before = servers()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path)}
    probe = ("import os, sys, urllib.request; url = os.environ['PREFECT_API_URL']; "
             "print(url, urllib.request.urlopen(url + '/health', timeout=10).read().decode()); sys.exit(3)")
    out = subprocess.run([str(WRAPPER), str(ROOT / ".venv" / "bin" / "python"), "-c", probe], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 3, out.stderr  # the command's own status
    url, health = out.stdout.strip().splitlines()[-1].split()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/api") and health == "true"
    assert servers() <= before  # stopped with the command
    assert (tmp_path / "server.log").exists()


def test_a_server_of_your_own_is_used_as_it_is(tmp_path):
    env = os.environ | {"PREFECT_API_URL": "http://example.invalid:4200/api", "PREFECT_HOME": str(tmp_path)}
    out = subprocess.run([str(WRAPPER), "sh", "-c", 'echo "$PREFECT_API_URL"; exit 5'], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 5 and out.stdout.strip() == "http://example.invalid:4200/api"
    assert not (tmp_path / "server.log").exists()  # no server started
