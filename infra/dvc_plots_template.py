"""Build the page template `dvc plots show` fills, with Vega, Vega-Lite and Vega-Embed inlined.

Run: ``make plots-template`` (or ``python infra/dvc_plots_template.py``). ``.dvc/config`` names the
result (``plots.html_template``), so ``dvc plots show`` writes a page that loads no script from the
network; DVC's own page loads all three from a CDN and renders blank offline.

The three npm packages are fetched with ``npm pack`` (one tarball each, ~6 MB together, no
dependency tree: each ships a ready UMD bundle under ``build/``), pinned by version and checked
against the sha512 integrity the npm registry publishes, then cached in ``infra/vega/`` (ignored
by git). DVC fills ``{plot_divs}`` with one ``vegaEmbed(...)`` call per plot; the page has no
``{scripts}`` placeholder, so DVC adds no CDN tag.
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "infra" / "vega"
TEMPLATE = CACHE / "dvc_plots_template.html"

# (package, version, file in the tarball, npm's sha512 integrity of the tarball). Vega-Embed 6
# and Vega-Lite 5 are the majors DVC's own page loads (vega@5.20, vega-lite@5.2, vega-embed@6.18).
PACKAGES = (
    ("vega", "5.33.1", "package/build/vega.min.js",
     "sha512-1fArfVDUqVbb5z8n+/nVQb+VNBzx8svY6CrsyTK4Ujm4yrd9I1auoKxBAPXLCavY1LcrbHUskQbGUP8gXOzyQw=="),
    ("vega-lite", "5.23.0", "package/build/vega-lite.min.js",
     "sha512-l4J6+AWE3DIjvovEoHl2LdtCUkfm4zs8Xxx7INwZEAv+XVb6kR6vIN1gt3t2gN2gs/y4DYTs/RPoTeYAuEg6mA=="),
    ("vega-embed", "6.29.0", "package/build/vega-embed.min.js",
     "sha512-PmlshTLtLFLgWtF/b23T1OwX53AugJ9RZ3qPE2c01VFAbgt3/GSNI/etzA/GzdrkceXFma+FDHNXUppKuM0U6Q=="),
)

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>scalelab: DVC plots</title>
    <!-- {versions}: inlined by infra/dvc_plots_template.py, so the page needs no network -->
{inline_scripts}
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
        img { max-width: 720px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def integrity(data: bytes) -> str:
    """npm's ``integrity`` string of a tarball: ``sha512-`` and the base64 of its SHA-512 digest."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def tarball(name: str, version: str, expected: str) -> bytes:
    """The package's tarball from the cache, else from ``npm pack``; refused unless its sha512 matches."""
    path = CACHE / f"{name}-{version}.tgz"
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit(f"{TEMPLATE.relative_to(ROOT)}: needs npm to fetch {name}@{version} "
                             "(Debian: apt-get install npm); without it `dvc plots show` cannot render offline")
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "pack", f"{name}@{version}", "--pack-destination", str(CACHE), "--silent"],
                              capture_output=True, text=True)
        if done.returncode != 0 or not path.exists():
            raise SystemExit(f"npm pack {name}@{version} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    data = path.read_bytes()
    if integrity(data) != expected:
        path.unlink()
        raise SystemExit(f"{path}: sha512 does not match the pinned integrity of {name}@{version}; removed it")
    return data


def inline_script(source: str, what: str) -> str:
    # An inline script ends at the first "</script": escape it inside the code (the bundles have none today).
    # DVC replaces its placeholders with str.replace, so one inside the code would be filled too.
    for placeholder in ("{plot_divs}", "{scripts}", "{refresh_tag}"):
        if placeholder in source:
            raise SystemExit(f"{what}: its code contains DVC's placeholder {placeholder}; cannot inline it")
    code = source.replace("</script", "<\\/script")
    return f'    <script type="text/javascript">/* {what} */\n{code}\n    </script>'


def build(out: Path = TEMPLATE) -> Path:
    scripts = []
    for name, version, member, expected in PACKAGES:
        with tarfile.open(fileobj=io.BytesIO(tarball(name, version, expected)), mode="r:gz") as tar:
            source = tar.extractfile(member).read().decode("utf-8")
        scripts.append(inline_script(source, f"{name}@{version}"))
    page = (PAGE.replace("{versions}", ", ".join(f"{n}@{v}" for n, v, _, _ in PACKAGES))
            .replace("{inline_scripts}", "\n".join(scripts)))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


if __name__ == "__main__":
    path = build()
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1e6:.2f} MB (Vega, Vega-Lite, Vega-Embed inlined)")
    sys.exit(0)
