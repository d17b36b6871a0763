"""infra/dvc_plots_template.py: pinned bundles checked by sha512, inlined safely, no script from the network."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("dvc_plots_template", ROOT / "infra" / "dvc_plots_template.py")
template = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(template)


def test_integrity_is_npms_sha512_format():
    # npm's integrity of an empty file (SRI: "sha512-" + base64 of the digest)
    assert template.integrity(b"") == ("sha512-z4PhNX7vuL3xVChQ1m2AB9Yg5AULVxXcg/SpIdNs6c5H0NE8XYXysP+DGNKH"
                                       "fuwvY7kxvUdBeoGlODJ6+SfaPg==")


def test_inline_script_cannot_end_early_or_collide_with_dvcs_placeholders():
    out = template.inline_script('var s = "</script><b>";', "x@1")
    assert out.count("</script") == 1 and out.endswith("</script>") and "<\\/script><b>" in out
    with pytest.raises(SystemExit, match=r"\{plot_divs\}"):
        template.inline_script("var t = '{plot_divs}';", "x@1")


def test_a_tarball_that_does_not_match_its_pin_is_refused_and_removed(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(template, "CACHE", tmp_path)
    (tmp_path / "vega-5.33.1.tgz").write_bytes(b"not the real tarball")
    with pytest.raises(SystemExit, match="sha512 does not match"):
        template.tarball("vega", "5.33.1", template.PACKAGES[0][3])
    assert not (tmp_path / "vega-5.33.1.tgz").exists()


@pytest.mark.skipif(not all((template.CACHE / f"{n}-{v}.tgz").exists() for n, v, _, _ in template.PACKAGES),
                    reason="the npm tarballs are not cached: run `make plots-template` (needs npm)")
def test_the_built_page_holds_the_three_bundles_and_loads_nothing(tmp_path: Path):
    page = template.build(tmp_path / "page.html").read_text(encoding="utf-8")
    assert "{plot_divs}" in page and "{scripts}" not in page
    assert not re.search(r"<script[^>]*\ssrc=", page)
    for name, version, _, _ in template.PACKAGES:
        assert f"/* {name}@{version} */" in page
