"""tasks.compression.distill: CSD's shift invariance and its O(V) form against the pairwise definition,
KL and DLD, gradients, and a recovery run that brings a pruned tiny Llama back towards its teacher."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tasks.compression.block_pruning import remove_blocks
from tasks.compression.distill import (
    DistillConfig,
    concrete_score_distillation,
    concrete_score_distillation_pairwise,
    csd_weighting,
    direct_logit_distillation,
    distillation_loss,
    forward_kl,
    recover,
)
from tests.tasks.compression.test_block_pruning import VOCAB, tiny_llama

WEIGHTINGS = ["mode_seeking", "mode_covering", "teacher/teacher", "uniform/student", "uniform/uniform"]


def pair(shape, seed: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(shape, generator=g), scale * torch.randn(shape, generator=g)


def fresh_mask(shape, seed: int) -> torch.Tensor:
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.7
    mask[0, 0] = True
    return mask


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_csd_is_zero_when_the_student_is_the_teacher_up_to_a_shift_and_dld_is_not(weighting):
    _, teacher = pair((3, 5, 63), seed=0)
    shift = 10.0 * torch.randn(3, 5, 1, generator=torch.Generator().manual_seed(1))  # one constant per position
    student = teacher + shift
    assert concrete_score_distillation(student, teacher, weighting=weighting).item() == pytest.approx(0.0, abs=1e-9)
    assert forward_kl(student, teacher).item() == pytest.approx(0.0, abs=1e-5)  # same distributions
    assert direct_logit_distillation(student, teacher).item() == pytest.approx(shift.pow(2).mean().item(), rel=1e-5)
    # A change of relative logits is not free.
    bumped = student.clone()
    bumped[..., 0] += 1.0
    assert concrete_score_distillation(bumped, teacher, weighting=weighting).item() > 1e-4


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("shape", [(2, 3, 7), (1, 4, 63), (3, 2, 500)], ids=lambda s: "x".join(map(str, s)))
def test_csd_linear_form_equals_the_pairwise_sum_and_its_gradient(shape, weighting):
    s0, t = pair(shape, seed=shape[-1])
    s0 = s0 + 25.0  # a large common offset: the O(V) form must not lose the differences to cancellation
    mask = fresh_mask(shape[:-1], seed=3)
    s_lin = s0.clone().requires_grad_(True)
    s_pair = s0.double().clone().requires_grad_(True)
    lin = concrete_score_distillation(s_lin, t, mask, weighting=weighting)
    ref = concrete_score_distillation_pairwise(s_pair, t, mask, weighting=weighting)
    assert lin.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-7)
    lin.backward()
    ref.backward()
    torch.testing.assert_close(s_lin.grad.double(), s_pair.grad, rtol=1e-3, atol=1e-7)


def test_mode_seeking_csd_is_the_student_weighted_variance_of_the_logit_gap():
    s, t = pair((4, 31), seed=5)
    p = F.softmax(s, -1)
    d = s - t
    var = (p * d * d).sum(-1) - (p * d).sum(-1) ** 2
    assert concrete_score_distillation(s, t, weighting="mode_seeking").item() == pytest.approx(var.mean().item(), rel=1e-4)


def test_csd_weights_carry_no_gradient():
    # With a = b = p_S detached, dL/ds_k = 2 p_k (d_k - E_p d) / positions.
    s0, t = pair((1, 1, 40), seed=6)
    s = s0.clone().requires_grad_(True)
    concrete_score_distillation(s, t, weighting="mode_seeking").backward()
    p, d = F.softmax(s0, -1), s0 - t
    torch.testing.assert_close(s.grad, 2 * p * (d - (p * d).sum(-1, keepdim=True)), rtol=1e-4, atol=1e-7)


def test_forward_kl_is_zero_on_equal_logits_and_matches_torch():
    s, t = pair((2, 6, 50), seed=7)
    assert forward_kl(t, t).item() == pytest.approx(0.0, abs=1e-7)
    expected = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum") / 12
    assert forward_kl(s, t).item() == pytest.approx(expected.item(), rel=1e-5)
    tau = 2.0
    soft = F.kl_div(F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1), log_target=True, reduction="sum") / 12
    assert forward_kl(s, t, temperature=tau).item() == pytest.approx(tau**2 * soft.item(), rel=1e-5)


@pytest.mark.parametrize("loss", ["csd", "kl", "dld"])
def test_gradients_flow_to_the_student_only_and_masked_positions_do_not_count(loss):
    s0, t = pair((2, 5, 33), seed=8)
    mask = fresh_mask((2, 5), seed=9)
    cfg = DistillConfig(loss=loss)
    s = s0.clone().requires_grad_(True)
    teacher = t.clone().requires_grad_(True)
    value = distillation_loss(s, teacher, mask, cfg)
    value.backward()
    assert value.item() > 0 and torch.isfinite(s.grad).all()
    assert s.grad[mask].abs().sum() > 0 and s.grad[~mask].abs().sum() == 0
    changed = s0.clone()
    changed[~mask] += torch.randn_like(changed[~mask])
    assert distillation_loss(changed, t, mask, cfg).item() == pytest.approx(value.item(), rel=1e-6)


def test_shapes_and_weighting_names_are_checked():
    s, t = pair((2, 3, 10), seed=0)
    with pytest.raises(ValueError, match="teacher_logits: shape"):
        concrete_score_distillation(s, t[..., :9])
    with pytest.raises(ValueError, match="mask: shape"):
        forward_kl(s, t, torch.ones(3, 2))
    with pytest.raises(ValueError, match="^weighting: 'mode_avoiding'"):
        DistillConfig(weighting="mode_avoiding")
    with pytest.raises(ValueError, match="^loss: "):
        DistillConfig(loss="jsd")
    with pytest.raises(ValueError, match="^steps: "):
        DistillConfig(steps=0)
    assert csd_weighting("mode_covering") == ("teacher", "student") and csd_weighting("uniform/teacher") == ("uniform", "teacher")


# ------------------------------------------------------------------------------------------------
# Recovery


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(4, seed=3)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, VOCAB, (128, 32), generator=torch.Generator().manual_seed(11))


def held_out_loss(student, teacher, tokens, cfg) -> float:
    with torch.no_grad():
        return distillation_loss(student(input_ids=tokens).logits, teacher(input_ids=tokens).logits, None, cfg).item()


@pytest.mark.parametrize("loss", ["csd", "kl", "dld"])
def test_recover_brings_a_pruned_student_towards_its_teacher(teacher, windows, loss):
    student = copy.deepcopy(teacher)
    remove_blocks(student, [1], "layer")
    cfg = DistillConfig(loss=loss, steps=20, lr=1e-3, batch_size=8, seed=0)
    held_out = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(12))
    before = held_out_loss(student, teacher, held_out, cfg)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    curve = recover(student, teacher, windows, cfg)
    after = held_out_loss(student, teacher, held_out, cfg)
    assert len(curve.losses) == 20 and curve.tokens == 20 * 8 * 32
    assert after < 0.75 * before  # on windows it never saw (0.57-0.60 of the start here)
    assert sum(curve.losses[-3:]) / 3 < curve.losses[0]
    assert not student.training  # mode restored
    assert all(torch.equal(teacher_state[k], v) for k, v in teacher.state_dict().items())  # the teacher is not trained


def test_recover_is_deterministic_and_takes_a_token_stream(teacher, windows):
    cfg = DistillConfig(loss="csd", steps=3, lr=1e-3, batch_size=2, seq_len=32)
    a, b = copy.deepcopy(teacher), copy.deepcopy(teacher)
    remove_blocks(a, [2], "layer")
    remove_blocks(b, [2], "layer")
    curve_windows = recover(a, teacher, windows, cfg)
    curve_stream = recover(b, teacher, windows.flatten().numpy(), cfg)
    assert curve_windows.losses == curve_stream.losses
    with pytest.raises(ValueError, match="^tokens: no window"):
        recover(a, teacher, windows.flatten()[:1], cfg)


def test_recover_curve_evaluates_at_the_ends_and_every_n_steps_without_changing_the_training(teacher, windows):
    cfg = DistillConfig(loss="kl", steps=5, lr=1e-3, batch_size=2, seq_len=32)
    held_out = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(3))
    a, b = copy.deepcopy(teacher), copy.deepcopy(teacher)
    remove_blocks(a, [1], "layer")
    remove_blocks(b, [1], "layer")
    score = lambda m: held_out_loss(m, teacher, held_out, cfg)  # noqa: E731
    start = score(a)
    plain = recover(a, teacher, windows, cfg)
    traced = recover(b, teacher, windows, cfg, evaluate=score, every=2)
    assert [s for s, _, _ in traced.evals] == [0, 2, 4, 5]
    assert [t for _, t, _ in traced.evals] == [0, 2 * 64, 4 * 64, 5 * 64]
    assert traced.evals[0][2] == start and traced.evals[-1][2] == score(b)
    assert plain.evals == [] and plain.losses == traced.losses  # evaluating between steps changes no update
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert recover(copy.deepcopy(b), teacher, windows, cfg, evaluate=score, initial=1.5).evals[0] == (0, 0, 1.5)
    with pytest.raises(ValueError, match="^every"):
        recover(b, teacher, windows, cfg, evaluate=score, every=-1)
