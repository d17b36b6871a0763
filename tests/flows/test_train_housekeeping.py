"""The train flow removes only the model folders it owns."""

from __future__ import annotations

from flows.train import OWNER_FILE, remove_stale_models
from tasks.common.io import write_json


def test_only_this_presets_stale_folders_of_trained_series_are_removed(tmp_path):
    trained = tmp_path / "models" / "trained"
    folders = {}
    for name, owner in {
        "raw/d16_l1_D100-old": {"preset": "demo", "variant": "raw"},      # stale, ours: removed
        "raw/d16_l1_D100-new": {"preset": "demo", "variant": "raw"},      # in the current ladder: kept
        "raw/d16_l1_D100-ci": {"preset": "ci", "variant": "raw"},         # another preset's: kept
        "c4/d16_l1_D100-old": {"preset": "demo", "variant": "c4"},        # a series not trained now: kept
        "raw/hand-made": None,                                            # no owner record: kept
    }.items():
        d = trained / name
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
        if owner is not None:
            write_json(d / OWNER_FILE, owner)
        folders[name] = d
    removed = remove_stale_models(trained, {"raw"}, "demo", keep={folders["raw/d16_l1_D100-new"]})
    assert removed == [folders["raw/d16_l1_D100-old"]]
    assert not folders["raw/d16_l1_D100-old"].exists()
    assert all(d.exists() for n, d in folders.items() if n != "raw/d16_l1_D100-old")
