"""The series a curated variant is trained as: its plain arm and the compared arms the config asks for.

A compared arm trains the plain arm's points on the same data, for the same optimizer steps, with
the same seed, and differs in one thing, so the fit stage can compare the two series document by
document (``tasks.scaling.decisions``):

* ``+repb`` (``repb.compare``): RePB dynamic data pruning on (:mod:`tasks.training.repb`);
* ``+<arch>`` (``arch_compare``): the other architecture (``+xlstm`` when ``arch: llama``,
  ``+llama`` when ``arch: xlstm``; :mod:`tasks.lm.model`), without RePB.
"""

from __future__ import annotations

import dataclasses

from tasks.training.config import TrainingConfig
from tasks.training.repb import repb_arms


def training_arms(cfg: TrainingConfig, variant: str) -> list[tuple[str, TrainingConfig]]:
    """Every arm ``cfg`` asks for on ``variant``: ``[(label suffix, config)]``, the plain arm (``""``) first.

    RePB's arms are :func:`tasks.training.repb.repb_arms`' unchanged (labels and configs). With
    ``variant`` in ``cfg.arch_compare`` the plain arm's config with ``arch`` set to
    ``cfg.other_arch`` follows, labelled ``+<other arch>``.
    """
    arms = repb_arms(cfg, variant)
    if variant in cfg.arch_compare:
        plain = arms[0][1]
        arms.append((f"+{cfg.other_arch}", dataclasses.replace(plain, arch=cfg.other_arch, arch_compare=())))
    return arms
