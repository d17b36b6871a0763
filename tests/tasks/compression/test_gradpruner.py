"""tasks.compression.gradpruner: the IGIA-Matrix is the mean squared (or absolute) gradient of the
first fine-tuning steps, the lowest-IGIA layers go, and only same-sign elements of their top-density
part are merged into the neighbouring kept layer; the pruned model runs, caches and reloads."""

from __future__ import annotations

import copy

import pytest
import torch

from tasks.compression.block_pruning import n_params
from tasks.compression.gradpruner import (
    GradPrunerConfig,
    gradpruner,
    igia_matrices,
    layer_linear_parameters,
    merge_targets,
    next_token_loss,
    sign_consistent_merge,
    top_density_mask,
)
from tests.tasks.compression.test_block_pruning import VOCAB, incremental_logits, logits, tiny_llama

QUIET = 3  # the layer whose weights are scaled towards zero, so its gradients nearly vanish


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def calib():
    return torch.randint(0, VOCAB, (8, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def held_out():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


def quiet_layer(model, layer: int, scale: float = 1e-3):
    """A copy whose ``layer`` has every linear weight scaled by ``scale``: a near-identity layer
    through which (and into which) almost no gradient flows."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in layer_linear_parameters(m.model.layers[layer]).values():
            p.mul_(scale)
    return m


def cfg(**kw) -> GradPrunerConfig:
    return GradPrunerConfig(**({"seq_len": 48, "steps": 2, "batch_size": 4, "lr": 1e-4} | kw))


# ------------------------------------------------------------------------------------------------
# Sign-consistent merge


def test_merge_adds_only_top_density_elements_whose_signs_agree_on_a_hand_made_case():
    kept = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.5, -1.0]])
    pruned = torch.tensor([[0.5, 0.7, 0.4], [-1.0, 0.2, -0.3]])
    importance = torch.tensor([[6.0, 5.0, 4.0], [3.0, 1.0, 2.0]])
    # Top 4 of 6 by importance: (0,0) (0,1) (0,2) (1,0). Of these only (0,0) has the kept sign:
    # (0,1) and (1,0) disagree, (0,2) meets a zero. (1,1) and (1,2) agree but are outside the top 4.
    merged, mask = sign_consistent_merge(kept, pruned, importance, density=4 / 6)
    assert mask.tolist() == [[True, False, False], [False, False, False]]
    assert merged.tolist() == [[1.5, -2.0, 0.0], [3.0, 0.5, -1.0]]
    # Everything offered, half the weight: the two agreeing elements outside the top-4 now count.
    merged, mask = sign_consistent_merge(kept, pruned, importance, density=1.0, scale=0.5)
    assert mask.tolist() == [[True, False, False], [False, True, True]]
    torch.testing.assert_close(merged, torch.tensor([[1.25, -2.0, 0.0], [3.0, 0.6, -1.15]]))


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", [(63, 17), (5, 500)], ids=["63x17", "5x500"])
def test_merge_changes_exactly_the_agreeing_elements_of_the_top_density_mask(shape, density):
    g = torch.Generator().manual_seed(0)
    kept, pruned, importance = (torch.randn(shape, generator=g) for _ in range(3))
    merged, mask = sign_consistent_merge(kept, pruned, importance.abs(), density)
    top = top_density_mask(importance.abs(), density)
    assert int(top.sum()) == round(density * kept.numel())
    if top.any():  # the mask is the top of the importance: nothing outside beats anything inside
        assert importance.abs()[top].min() >= importance.abs()[~top].max() if (~top).any() else True
    expected = top & (torch.sign(kept) == torch.sign(pruned))
    assert torch.equal(mask, expected)
    assert torch.equal(merged[~mask], kept[~mask])
    torch.testing.assert_close(merged[mask], kept[mask] + pruned[mask], rtol=0, atol=0)
    # A merged element moves away from zero: its magnitude only grows.
    assert (merged[mask].abs() > kept[mask].abs()).all()


def test_merge_targets_take_the_previous_kept_layer_and_fall_back_to_the_next():
    assert merge_targets(6, [0, 3, 4], "previous") == {0: 1, 3: 2, 4: 2}
    assert merge_targets(6, [0, 3, 5], "next") == {0: 1, 3: 4, 5: 4}
    with pytest.raises(ValueError, match="^removed: all 2 layers"):
        merge_targets(2, [0, 1])


# ------------------------------------------------------------------------------------------------
# IGIA-Matrix


def full_batch_gradients(model, calib) -> list[dict[str, torch.Tensor]]:
    """Each decoder linear parameter's gradient of the next-token loss over all windows at once."""
    m = copy.deepcopy(model).train()
    loss = next_token_loss(m, calib)
    loss.backward()
    return [{n: p.grad.clone() for n, p in layer_linear_parameters(layer).items()} for layer in m.model.layers]


@pytest.mark.parametrize("accumulate", ["squared", "abs"])
def test_igia_is_the_mean_over_steps_of_the_squared_or_absolute_gradient(model, calib, accumulate):
    # Two full-batch steps at lr 0 see the same gradient twice: the mean is g² (a sum would be 2g²).
    igia = igia_matrices(model, cfg(steps=2, batch_size=8, lr=0.0, accumulate=accumulate), calib_tokens=calib)
    grads = full_batch_gradients(model, calib)
    assert len(igia.matrices) == 6 and set(igia.matrices[0]) == set(grads[0])
    assert set(grads[0]) == {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    for layer, ref in zip(igia.matrices, grads):
        for name, g in ref.items():
            want = g * g if accumulate == "squared" else g.abs()
            # The batch is the windows in another order: sums round differently, so the tolerance is
            # relative to the matrix's scale (a sum of g, or 2g², would miss by orders of magnitude).
            torch.testing.assert_close(layer[name], want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))
    scores = igia.layer_scores()
    assert scores[2] == pytest.approx(sum(float(v.double().sum()) for v in igia.matrices[2].values()))
    assert len(igia.losses) == 2 and igia.losses[0] == pytest.approx(igia.losses[1], rel=1e-5)


def test_igia_steps_train_the_copy_and_leave_the_model_unchanged(model, calib):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    igia = igia_matrices(model, cfg(steps=4, lr=1e-3, batch_size=8), calib_tokens=calib, keep_finetuned=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    tuned = igia.finetuned.state_dict()
    assert not torch.equal(tuned["model.layers.2.mlp.up_proj.weight"], before["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(tuned["model.embed_tokens.weight"], before["model.embed_tokens.weight"])  # frozen, as under LoRA
    assert igia.losses[-1] < igia.losses[0]  # the same full batch four times: fine-tuning lowers its loss


# ------------------------------------------------------------------------------------------------
# Choosing and removing layers


def test_the_layer_with_vanishing_gradients_is_removed(model, calib):
    m = quiet_layer(model, QUIET)
    pruned = gradpruner(m, cfg(n_remove=1), calib_tokens=calib)
    s = pruned.scores.scores
    assert pruned.removed == [QUIET]
    assert s[QUIET] < 1e-3 * min(v for l, v in enumerate(s) if l != QUIET)
    # A near-identity layer merged into its neighbour and removed: the function barely moves.
    torch.testing.assert_close(logits(pruned.model, calib[:2]), logits(m, calib[:2]), rtol=0, atol=1e-2)


def test_the_lowest_scoring_candidates_are_removed_and_merged_as_specified(model, calib):
    c = cfg(n_remove=2, density=0.3)
    pruned = gradpruner(model, c, calib_tokens=calib)
    s = pruned.scores
    assert s.candidates == [0, 1, 2, 3, 4]  # keep_last=1 protects layer 5
    assert pruned.removed == sorted(sorted(s.candidates, key=lambda l: s.scores[l])[:2])
    assert pruned.merged_into == merge_targets(6, pruned.removed, "previous")

    # Recompute the merges from the same (seeded, deterministic) IGIA-Matrices and the original weights.
    igia = igia_matrices(model, c, calib_tokens=calib)
    expected = {l: {n: p.detach().clone() for n, p in layer_linear_parameters(model.model.layers[l]).items()}
                for l in range(6)}
    merged_count = dict.fromkeys(pruned.removed, 0)
    for p in pruned.removed:
        k = pruned.merged_into[p]
        for name, w_p in layer_linear_parameters(model.model.layers[p]).items():
            expected[k][name], mask = sign_consistent_merge(expected[k][name], w_p.detach(), igia.matrices[p][name], 0.3)
            merged_count[p] += int(mask.sum())
    assert pruned.merged_elements == merged_count and all(v > 0 for v in merged_count.values())
    kept = [l for l in range(6) if l not in pruned.removed]
    for new_idx, old in enumerate(kept):
        got = layer_linear_parameters(pruned.model.model.layers[new_idx])
        for name, w in expected[old].items():
            assert torch.equal(got[name], w), (old, name)
        # Norms are never merged.
        assert torch.equal(pruned.model.model.layers[new_idx].input_layernorm.weight,
                           model.model.layers[old].input_layernorm.weight)
    meta = pruned.meta()
    assert meta["method"] == "gradpruner" and meta["removed"] == pruned.removed
    assert meta["merged_elements"] == {str(k): v for k, v in merged_count.items()}
    assert meta["params_removed"] == n_params(model) - n_params(pruned.model) > 0


def test_density_zero_is_plain_removal(model, calib):
    pruned = gradpruner(model, cfg(n_remove=1, density=0.0), calib_tokens=calib)
    kept = [l for l in range(6) if l not in pruned.removed]
    for new_idx, old in enumerate(kept):
        for (n, a), (_, b) in zip(pruned.model.model.layers[new_idx].state_dict().items(),
                                  model.model.layers[old].state_dict().items()):
            assert torch.equal(a, b), (old, n)
    assert pruned.merged_into == {} and pruned.merged_elements == {}


def test_finetuned_weights_start_from_the_igia_steps(model, calib):
    c = cfg(n_remove=1, weights="finetuned", lr=1e-3)
    pruned = gradpruner(model, c, calib_tokens=calib)
    tuned = igia_matrices(model, c, calib_tokens=calib, keep_finetuned=True).finetuned
    untouched = next(l for l in range(6) if l not in pruned.removed and l not in pruned.merged_into.values())
    new_idx = untouched - sum(r < untouched for r in pruned.removed)
    for (n, a), (_, b) in zip(pruned.model.model.layers[new_idx].state_dict().items(),
                              tuned.model.layers[untouched].state_dict().items()):
        assert torch.equal(a, b), n
    assert not torch.equal(pruned.model.model.layers[new_idx].mlp.up_proj.weight,
                           model.model.layers[untouched].mlp.up_proj.weight)


def test_the_pruned_model_runs_with_a_kv_cache_reloads_and_the_original_is_unchanged(model, calib, held_out, tmp_path):
    from transformers import LlamaForCausalLM

    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = gradpruner(model, cfg(n_remove=2), calib_tokens=calib)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    m = pruned.model
    assert m.config.num_hidden_layers == len(m.model.layers) == 4
    assert [l.self_attn.layer_idx for l in m.model.layers] == [0, 1, 2, 3]
    full = logits(m, held_out)
    assert full.shape == (2, 24, VOCAB) and torch.isfinite(full).all()
    torch.testing.assert_close(incremental_logits(m, held_out, prefix=10), full, rtol=1e-4, atol=1e-4)
    m.save_pretrained(tmp_path)
    torch.testing.assert_close(logits(LlamaForCausalLM.from_pretrained(tmp_path).eval(), held_out), full, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize("kwargs,field", [
    ({"n_remove": 0}, "n_remove"),
    ({"steps": 0}, "steps"),
    ({"lr": -1.0}, "lr"),
    ({"accumulate": "signed"}, "accumulate"),
    ({"density": 1.5}, "density"),
    ({"merge_scale": 0.0}, "merge_scale"),
    ({"merge_into": "both"}, "merge_into"),
    ({"weights": "merged"}, "weights"),
    ({"seq_len": 1}, "seq_len"),
    ({"keep_last": -1}, "keep_last"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        GradPrunerConfig(**kwargs)


def test_more_layers_than_candidates_and_missing_tokens_say_what_to_change(model, calib):
    with pytest.raises(ValueError, match="^n_remove: 6 layer blocks asked for, but only 5"):
        gradpruner(model, cfg(n_remove=6), calib_tokens=calib)
    with pytest.raises(ValueError, match="gradpruner needs calibration tokens"):
        gradpruner(model, cfg(), calib_tokens=None)
