"""tasks.lm.windows: a token stream cut into (n, T) model inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.lm.windows import token_windows


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16], ids=["int64", "int32", "uint16"])
def test_a_stream_is_cut_into_non_overlapping_windows_dropping_the_rest(dtype):
    tokens = np.arange(500, dtype=dtype)
    windows = token_windows(tokens, 63)
    assert windows.dtype == torch.int64 and tuple(windows.shape) == (7, 63)
    assert windows.flatten().tolist() == list(range(7 * 63))


def test_windows_pass_through_and_short_streams_give_none():
    given = torch.arange(12).view(3, 4).int()
    assert torch.equal(token_windows(given, 99), given.long())
    assert tuple(token_windows(np.arange(5), 8).shape) == (0, 8)
    with pytest.raises(ValueError, match="1-D stream"):
        token_windows(np.zeros((2, 3, 4)), 4)
