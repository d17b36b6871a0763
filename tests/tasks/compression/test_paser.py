"""tasks.compression.paser: degradation, clustering, budget allocation and the selection order."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tasks.compression.paser import (
    PaserConfig,
    allocate,
    cluster,
    paser_select,
    random_select,
    sample_degradation,
)
from tests.tasks.compression.test_block_pruning import VOCAB, tiny_llama


def test_allocate_is_proportional_capped_and_exact():
    assert allocate([1, 1, 2], [10, 10, 10], 8).tolist() == [2, 2, 4]
    # the third cluster can give only 1: its share goes to the others in proportion
    assert allocate([1, 1, 6], [10, 10, 1], 9).tolist() == [4, 4, 1]
    assert allocate([0, 0], [3, 3], 4).sum() == 4  # no signal: shared evenly
    assert allocate([1, 2], [1, 1], 5).tolist() == [1, 1]  # never more than there is
    counts = allocate(np.random.default_rng(0).random(7), np.full(7, 5), 23)
    assert counts.sum() == 23 and (counts <= 5).all()


def blobs(n_per: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.eye(16)[:3] * 5
    x = np.concatenate([c + 0.3 * rng.standard_normal((n_per, 16)) for c in centres])
    return x.astype(np.float32), np.repeat(np.arange(3), n_per)


def test_cluster_recovers_separated_groups():
    x, truth = blobs()
    labels = cluster(x, PaserConfig(n_clusters=3, n_neighbors=6))
    # the same partition up to renaming
    assert len({(t, l) for t, l in zip(truth, labels)}) == 3
    assert cluster(x[:3], PaserConfig()).tolist() == [0, 0, 0]


def test_selection_follows_cluster_degradation_and_efficiency():
    x, labels = blobs()
    deg = np.where(labels == 2, 1.0, 0.1) + np.linspace(0, 0.01, len(labels))
    sel = paser_select(x, deg, np.full(len(deg), 16), 12, PaserConfig(irrelevant_quantile=0, redundancy_threshold=1),
                       labels=labels)
    chosen = labels[sel.indices]
    # cluster 2 degraded ten times more: it gets 10/12 of the budget ("mass" allocation at equal sizes)
    assert sel.allocation == {0: 1, 1: 1, 2: 10} and (chosen == 2).sum() == 10
    # inside cluster 2 the most degraded come first
    top = [i for i in sel.indices if labels[i] == 2]
    assert top == sorted(top, key=lambda i: -deg[i])
    # shorter windows are cheaper: at equal degradation the shorter one is preferred
    lengths = np.full(len(deg), 64)
    lengths[24] = 4  # cluster 2's least degraded member
    sel = paser_select(x, deg, lengths, 3, PaserConfig(irrelevant_quantile=0, redundancy_threshold=1), labels=labels)
    assert 24 in sel.indices.tolist()


def test_irrelevant_and_redundant_candidates_are_skipped():
    x, labels = blobs()
    deg = np.linspace(0.0, 1.0, len(labels))
    sel = paser_select(x, deg, np.full(len(deg), 16), 6, PaserConfig(irrelevant_quantile=0.5, redundancy_threshold=1),
                       labels=labels)
    assert sel.dropped_irrelevant == 18 and (deg[sel.indices] > np.median(deg)).all()
    dup = x.copy()
    dup[35] = dup[34]  # the two most degraded are the same text
    sel = paser_select(dup, deg, np.full(len(deg), 16), 2, PaserConfig(irrelevant_quantile=0, redundancy_threshold=0.99),
                       labels=np.zeros(len(deg), int))
    assert sel.indices.tolist() == [35, 33] and sel.skipped_redundant == 1


def test_degradation_is_zero_for_an_identical_model_and_grows_with_damage():
    model = tiny_llama(2)
    windows = torch.as_tensor(np.random.default_rng(0).integers(0, VOCAB, (6, 16)))
    for kind in ("jsd", "loss"):
        assert np.allclose(sample_degradation(model, copy.deepcopy(model), windows, kind=kind), 0, atol=1e-6)
    damaged = copy.deepcopy(model)
    with torch.no_grad():
        damaged.model.layers[1].mlp.down_proj.weight.mul_(5)
    jsd = sample_degradation(model, damaged, windows, kind="jsd", batch_size=4)
    assert jsd.shape == (6,) and (jsd > 0).all() and (jsd <= np.log(2) + 1e-9).all()


def test_random_select_and_bad_input():
    idx = random_select(10, 4, seed=1).indices
    assert len(set(idx.tolist())) == 4 and idx.max() < 10
    with pytest.raises(ValueError, match="differ in length"):
        paser_select(np.zeros((3, 2)), np.zeros(4), np.ones(3), 1, PaserConfig())
    with pytest.raises(ValueError, match="redundancy_threshold"):
        PaserConfig(redundancy_threshold=0)
