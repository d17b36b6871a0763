"""tasks.compression.pruning: the prune stage's config, FLOPs accounting and per-model rows."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from tasks.common.config import ConfigError, from_mapping
from tasks.compression.block_pruning import EntroDropConfig, remove_blocks
from tasks.compression.pruning import (
    CachedTeacher,
    PruningConfig,
    RecoveryConfig,
    SaveConfig,
    forward_flops_per_token,
    largest_per_variant,
    matmul_params,
    prune,
    prune_rows,
)
from tests.tasks.compression.test_block_pruning import VOCAB, tiny_llama, with_identity


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int64)


SETTINGS = {"e": {"method": "entrodrop", "n_remove": 1, "seq_len": 32, "calib_windows": 2, "phase": "all"},
            "c": {"method": "cosine_drop", "n_remove": 1, "seq_len": 32, "calib_windows": 2}}


def test_config_checks_settings_and_recovery_keys():
    cfg = from_mapping(PruningConfig, {"settings": SETTINGS, "recovery": {"losses": ["csd", "kl"], "steps": 2}},
                       source="params/pruning.yaml", prefix="pruning")
    assert list(cfg.methods()) == ["e", "c"]
    assert cfg.recovery.distill("csd").weighting == "mode_seeking"
    assert cfg.recovery.distill("csd_cover").weighting == "mode_covering"
    with pytest.raises(ConfigError, match=r"params/pruning.yaml: pruning.recovery.losses.*unknown loss"):
        from_mapping(PruningConfig, {"settings": SETTINGS, "recovery": {"losses": ["mse"]}},
                     source="params/pruning.yaml", prefix="pruning")
    with pytest.raises(ConfigError, match=r"unknown pruning method 'svd'"):
        from_mapping(PruningConfig, {"settings": {"x": {"method": "svd"}}}, source="params/pruning.yaml", prefix="pruning")
    with pytest.raises(ConfigError, match=r"pruning.enabled.*not defined"):
        from_mapping(PruningConfig, {"settings": SETTINGS, "enabled": ["nope"]}, source="params/pruning.yaml",
                     prefix="pruning")
    with pytest.raises(ConfigError, match=r"pruning.settings.e.n_remove.*>= 1"):
        from_mapping(PruningConfig, {"settings": {"e": {"method": "entrodrop", "n_remove": 0}}},
                     source="params/pruning.yaml", prefix="pruning")


def test_pretrained_settings_default_to_the_enabled_ones():
    cfg = PruningConfig(settings=SETTINGS, enabled=("c",))
    assert list(cfg.methods(pretrained=True)) == ["c"]
    assert list(PruningConfig(settings=SETTINGS, pretrained_settings=("e",)).methods(pretrained=True)) == ["e"]


def test_the_demo_runs_every_method_loss_and_selector_on_the_ladder_and_entrodrop_on_smollm2():
    from pathlib import Path

    from tasks.common.params import load_stage_config
    from tasks.compression.pruning import RECOVERY_LOSSES

    root = Path(__file__).resolve().parents[3]
    demo, ci, full = (load_stage_config(PruningConfig, root, "pruning", p) for p in ("demo", "ci", "full"))
    assert ci.pretrained == () and demo.pretrained == full.pretrained == ("smollm2",)
    every = {"entrodrop", "cosine_drop", "gradpruner", "inhernet"}
    for cfg in (demo, full):
        assert {m for m, _ in cfg.methods().values()} == every
    # SmolLM2: every method in full; the demo (make demo's time) EntroDrop and its cosine baseline
    assert {m for m, _ in full.methods(pretrained=True).values()} == every
    assert {m for m, _ in demo.methods(pretrained=True).values()} == {"entrodrop", "cosine_drop"}

    def runs(cfg: PruningConfig, pretrained: bool) -> set[tuple[str, str]]:
        rc = cfg.pretrained_recovery if pretrained else cfg.recovery
        return {run for s in cfg.methods(pretrained=pretrained) for run in rc.runs(s)}

    # the ladder compares all four losses and both selectors in the demo, SmolLM2 CSD with KL and PASER
    assert {loss for loss, _ in runs(demo, False)} == set(RECOVERY_LOSSES)
    assert {select for _, select in runs(demo, False)} == {"random", "paser"}
    assert runs(demo, True) == {("csd", "random"), ("kl", "random"), ("csd", "paser")}
    # and on the settings compare_settings leaves out, one run each (CSD on random windows)
    demo_smol = demo.pretrained_recovery
    assert [s for s in demo.methods(pretrained=True) if len(demo_smol.runs(s)) > 1] == ["entrodrop_l2_256"]
    # full compares every loss and selector on every SmolLM2 setting
    assert all(len(full.pretrained_recovery.runs(s)) == len(RECOVERY_LOSSES) + 1 for s in full.methods(pretrained=True))


def test_flops_count_every_linear_and_the_attention_that_is_left():
    model = tiny_llama(4)
    # 4 layers x (q,k,v,o: 64*64 + 64*32*2 + 64*64, gate/up/down: 3*64*128) + head 64*256
    per_layer = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128
    assert matmul_params(model) == 4 * per_layer + 64 * VOCAB
    assert forward_flops_per_token(model, 100) == 2 * matmul_params(model) + 4 * 100 * 4 * 64
    attn_removed = copy.deepcopy(model)
    remove_blocks(attn_removed, [1], "attention")
    assert forward_flops_per_token(attn_removed, 100) == 2 * matmul_params(attn_removed) + 4 * 100 * 3 * 64
    assert matmul_params(attn_removed) == matmul_params(model) - (64 * 64 * 2 + 2 * 64 * 32)


def test_registered_pruners_run_through_prune():
    model = with_identity(tiny_llama(4), 2)
    result = prune(model, EntroDropConfig(n_remove=1, seq_len=32, calib_windows=2, phase="all"), calib_tokens=tokens(256, 1))
    assert result.meta()["removed"] == [2]
    assert len(result.model.model.layers) == 3 and len(model.model.layers) == 4


def test_cached_teacher_runs_the_teacher_once_per_batch():
    model = tiny_llama(2)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    teacher = CachedTeacher(model)
    x = torch.as_tensor(tokens(32, 2)).view(2, 16)
    a, b = teacher(input_ids=x).logits, teacher(input_ids=x).logits
    assert len(calls) == 1 and torch.equal(a, b)
    teacher(input_ids=x[:1])
    assert len(calls) == 2


def test_prune_rows_dense_pruned_and_recovered():
    model = with_identity(tiny_llama(4), 2)
    cfg = PruningConfig(settings=SETTINGS, recovery=RecoveryConfig(losses=("csd", "kl"), steps=2, batch_size=2,
                                                                   seq_len=32, tokens=512, lr=1e-3))
    logged = []
    rows, _ = prune_rows(model, settings=cfg.methods(), recovery=cfg.recovery, calib=tokens(256, 1),
                         train=tokens(512, 3), val=tokens(513, 4), seq_len=32, batch_size=4, eval_tokens=512,
                         base_row={"model": "tiny"}, log=lambda s, p, m, c: logged.append(s))
    assert [(r["setting"], r["recovery_loss"]) for r in rows] == [
        ("dense", "none"), ("e", "none"), ("e", "csd"), ("e", "kl"), ("c", "none"), ("c", "csd"), ("c", "kl")]
    assert logged == ["dense", "e", "e+csd+random", "e+kl+random", "c", "c+csd+random", "c+kl+random"]
    dense, pruned = rows[0], rows[1]
    assert dense["removed_fraction"] == 0 and dense["params"] > pruned["params"]
    assert pruned["removed"] == "2"  # the identity layer
    assert pruned["removed_fraction"] == pytest.approx(1 - pruned["params"] / dense["params"])
    assert pruned["flops_per_token"] < dense["flops_per_token"]
    # removing an exact identity layer changes no logit
    assert pruned["ppl"] == pytest.approx(dense["ppl"], rel=1e-5)
    for r in rows[2:4]:
        assert r["recovery_tokens"] == 2 * 2 * 32 and r["data_select"] == "random" and np.isfinite(r["ppl"])
        assert r["recovery_windows"] == 512 // 32  # budget 1: every candidate window
    assert all(r["model"] == "tiny" for r in rows)
    assert len(model.model.layers) == 4  # the input model is left unchanged


@pytest.mark.parametrize("steps, every, expected", [(4, 2, [0, 2, 4]), (5, 2, [0, 2, 4, 5]), (3, 0, [0, 3])],
                         ids=["every-2-of-4", "every-2-of-5-ends-on-5", "ends-only"])
def test_recovery_curve_runs_from_the_pruned_to_the_recovered_ppl(steps, every, expected):
    import math

    from tasks.lm.loss import evaluate_loss

    model = with_identity(tiny_llama(4), 2)
    rc = RecoveryConfig(losses=("csd", "kl"), steps=steps, batch_size=2, seq_len=32, tokens=512, lr=3e-3,
                        curve_every=every)
    val = tokens(513, 4)
    logged, saved = {}, {}

    def save(name, m):  # the model the row scored, scored again here
        saved[name] = math.exp(evaluate_loss(m, val, 32, 4, max_tokens=512))
        return f"kept/{name}"

    rows, curves = prune_rows(model, settings=PruningConfig(settings=SETTINGS, enabled=("c",)).methods(), recovery=rc,
                              calib=tokens(256, 1), train=tokens(512, 3), val=val, seq_len=32, batch_size=4,
                              eval_tokens=512, base_row={"model": "tiny", "variant": "raw"},
                              log=lambda s, p, m, c: logged.update({s: c}), save=save)
    pruned = next(r for r in rows if r["setting"] == "c" and r["recovery_loss"] == "none")
    for loss in ("csd", "kl"):
        row = next(r for r in rows if r["recovery_loss"] == loss)
        curve = [c for c in curves if c["recovery_loss"] == loss]
        assert [c["step"] for c in curve] == expected
        assert [c["recovery_tokens"] for c in curve] == [s * 2 * 32 for s in expected]
        assert curve[0]["ppl"] == pruned["ppl"] and curve[-1]["ppl"] == row["ppl"]
        assert saved[f"c+{loss}+random"] == pytest.approx(row["ppl"], rel=1e-6)
        assert row["model_path"] == f"kept/c+{loss}+random"
        assert logged[f"c+{loss}+random"] == curve
        assert {c["curve"] for c in curve} == {f"raw/tiny:c+{loss}+random"}
        assert all(c["method"] == "cosine_drop" and c["removed_fraction"] == pruned["removed_fraction"] for c in curve)
    assert saved["c"] == pytest.approx(pruned["ppl"], rel=1e-6) and logged["c"] == [] and logged["dense"] == []
    # the two losses start from the same pruned model and move it apart
    assert len({c["ppl"] for c in curves if c["step"] == steps}) == 2


def test_save_config_matches_row_names():
    cfg = SaveConfig()
    assert cfg.keeps("entrodrop_l1+csd+random") and not cfg.keeps("entrodrop_l1+kl+random")
    assert not cfg.keeps("entrodrop_l1")  # the pruned model before recovery
    assert SaveConfig(rows=("cosine_l1",)).keeps("cosine_l1") and not SaveConfig(rows=()).keeps("cosine_l1")
    with pytest.raises(ValueError, match="ladder"):
        SaveConfig(ladder="biggest")
    with pytest.raises(ValueError, match="curve_every"):
        RecoveryConfig(curve_every=-1)


def test_plot_recovery_curves_writes_a_png(tmp_path):
    from tasks.compression.pruning import plot_recovery_curves

    curves = [{"variant": "raw", "model": "m", "setting": s, "curve": f"raw/m:{s}+{loss}+random", "recovery_loss": loss,
               "data_select": "random", "step": k, "recovery_tokens": 64 * k, "ppl": 30.0 - k - (loss == "kl")}
              for s in ("a", "b") for loss in ("csd", "kl") for k in (0, 2, 4)]
    plot_recovery_curves(curves, tmp_path / "recovery.png")
    assert (tmp_path / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_largest_per_variant():
    rows = [{"variant": "raw", "run": "a", "n_params": 10, "tokens": 5}, {"variant": "raw", "run": "b", "n_params": 20, "tokens": 1},
            {"variant": "raw", "run": "c", "n_params": 20, "tokens": 9}, {"variant": "dedup", "run": "d", "n_params": 3, "tokens": 1}]
    assert [r["run"] for r in largest_per_variant(rows)] == ["c", "d"]


def test_recovery_runs_and_budget():
    rc = RecoveryConfig(losses=("csd", "kl"), data_select=("random", "paser"), budget=0.25)
    assert rc.runs() == [("csd", "random"), ("kl", "random"), ("csd", "paser")]
    with pytest.raises(ValueError, match="budget.*must be < 1 to compare selectors"):
        RecoveryConfig(data_select=("random", "paser"), budget=1.0)
    some = RecoveryConfig(losses=("csd", "kl"), data_select=("random", "paser"), budget=0.25, compare_settings=("c",))
    assert some.runs("c") == [("csd", "random"), ("kl", "random"), ("csd", "paser")]
    assert some.runs("e") == [("csd", "random")]  # the first loss on the first selector only
    assert RecoveryConfig(losses=()).runs() == []
    with pytest.raises(ValueError, match="pretrained_recovery.compare_settings.*not defined: \\['x'\\]"):
        PruningConfig(settings=SETTINGS, pretrained_recovery=dataclasses.replace(some, compare_settings=("x",)))
    with pytest.raises(ValueError, match="data_select"):
        RecoveryConfig(data_select=("best",))


def test_prune_rows_with_paser_selects_the_budget(monkeypatch):
    import tasks.compression.pruning as pruning_module

    # the sentence encoder is tested with DDCF; here the windows' "text" is their token histogram
    monkeypatch.setattr(pruning_module, "question_embeddings",
                        lambda texts: np.stack([np.bincount(list(map(int, t.split())), minlength=VOCAB) for t in texts])
                        .astype(np.float32))
    model = tiny_llama(4)
    rc = RecoveryConfig(losses=("csd",), data_select=("random", "paser"), budget=0.25, steps=1, batch_size=2,
                        seq_len=16, tokens=512)
    rows, _ = prune_rows(model, settings=PruningConfig(settings=SETTINGS, enabled=("c",)).methods(), recovery=rc,
                         calib=tokens(256, 1), train=tokens(512, 3), val=tokens(257, 4), seq_len=32, batch_size=4,
                         eval_tokens=256, base_row={}, texts=lambda w: [" ".join(map(str, r.tolist())) for r in w])
    rec = [r for r in rows if r["recovery_loss"] != "none"]
    assert [(r["recovery_loss"], r["data_select"]) for r in rec] == [("csd", "random"), ("csd", "paser")]
    assert all(r["recovery_windows"] == 8 for r in rec)  # 0.25 of 32 windows
    # compare_settings: PASER on one setting only; no embedding at all when none of them selects by PASER
    only_c = dataclasses.replace(rc, compare_settings=("c",))
    rows, _ = prune_rows(model, settings=PruningConfig(settings=SETTINGS).methods(), recovery=only_c,
                         calib=tokens(256, 1), train=tokens(512, 3), val=tokens(257, 4), seq_len=32, batch_size=4,
                         eval_tokens=256, base_row={}, texts=lambda w: [" ".join(map(str, r.tolist())) for r in w])
    assert [(r["setting"], r["data_select"]) for r in rows if r["recovery_loss"] != "none"] == [
        ("e", "random"), ("c", "random"), ("c", "paser")]
    monkeypatch.setattr(pruning_module, "question_embeddings", lambda texts: pytest.fail("embedded without a PASER run"))
    prune_rows(model, settings=PruningConfig(settings=SETTINGS, enabled=("e",)).methods(), recovery=only_c,
               calib=tokens(256, 1), train=tokens(512, 3), val=tokens(257, 4), seq_len=32, batch_size=4,
               eval_tokens=256, base_row={}, texts=lambda w: [" ".join(map(str, r.tolist())) for r in w])


def test_gradpruner_and_inhernet_rows_through_the_registry():
    model = tiny_llama(4)
    settings = {"g": {"method": "gradpruner", "n_remove": 1, "seq_len": 32, "calib_windows": 4, "steps": 2},
                "i": {"method": "inhernet", "target_fraction": 0.8, "allocation": "spectrum"}}
    cfg = PruningConfig(settings=settings, recovery=RecoveryConfig(losses=("kl",), steps=1, batch_size=2,
                                                                   seq_len=32, tokens=512))
    rows, _ = prune_rows(model, settings=cfg.methods(), recovery=cfg.recovery, calib=tokens(256, 1),
                         train=tokens(512, 3), val=tokens(513, 4), seq_len=32, batch_size=4, eval_tokens=512,
                         base_row={"model": "tiny"}, log=lambda *a: None)
    by = {(r["setting"], r["recovery_loss"]): r for r in rows}
    dense, grad, inher = by["dense", "none"], by["g", "none"], by["i", "none"]
    assert len(grad["removed"].split()) == 1 and grad["params"] < dense["params"]
    assert inher["removed"] == "" and inher["params"] <= 0.8 * dense["params"] + 64
    for r in (grad, inher):
        assert r["flops_per_token"] < dense["flops_per_token"] and np.isfinite(r["ppl"])
    assert np.isfinite(by["g", "kl"]["ppl"]) and np.isfinite(by["i", "kl"]["ppl"])


def test_flops_count_inhernet_factors():
    from tasks.compression.inhernet import InherLinear

    lin = InherLinear(64, 128, rank=8, heads=2)
    holder = torch.nn.Module()
    holder.o_proj = lin
    # down (8x64) + gate (2x8) + up (2x128x8); the factored o_proj still counts as an attention block
    assert matmul_params(holder) == 8 * 64 + 2 * 8 + 2 * 128 * 8
    assert forward_flops_per_token(holder, 10) == 2 * matmul_params(holder) + 4 * 10 * 64


def test_a_diverged_recovery_reads_as_infinite_perplexity_and_the_other_rows_stay(monkeypatch):
    """A mean loss past ~709.8 nats overflows exp(); the stage keeps the row (ppl inf) instead of failing."""
    from tasks.compression import pruning

    real = pruning.evaluate_loss
    calls = []

    def diverging_after_recovery(m, *args, **kwargs):
        calls.append(1)
        return 1e4 if len(calls) in (3, 4) else real(m, *args, **kwargs)  # the recovered model's curve end

    monkeypatch.setattr(pruning, "evaluate_loss", diverging_after_recovery)
    cfg = PruningConfig(settings={"c": SETTINGS["c"]}, recovery=RecoveryConfig(losses=("kl",), steps=1, batch_size=2,
                                                                                seq_len=32, tokens=256, lr=1e-3))
    rows, curves = prune_rows(with_identity(tiny_llama(3), 1), settings=cfg.methods(), recovery=cfg.recovery,
                              calib=tokens(256, 1), train=tokens(256, 3), val=tokens(257, 4), seq_len=32, batch_size=4,
                              eval_tokens=256, base_row={"model": "tiny"})
    assert [r["setting"] for r in rows] == ["dense", "c", "c"]
    assert np.isfinite(rows[0]["ppl"]) and np.isfinite(rows[1]["ppl"]) and rows[2]["ppl"] == float("inf")
