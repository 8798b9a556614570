"""The modeled-link transfer engine (runtime/transfer/link.py) and the hidden-share formula."""
from __future__ import annotations

import math

import pytest

from runtime.transfer.overlap import hidden_share, share_or_none


def test_hidden_share_formula():
    # 10 s of copies alone; the real run is 2 s slower than the satisfied one: 8 of 10 hidden.
    assert hidden_share(12.0, 10.0, 10.0) == pytest.approx(0.8)
    assert hidden_share(10.0, 10.0, 4.0) == pytest.approx(1.0)      # all hidden
    assert hidden_share(14.0, 10.0, 4.0) == pytest.approx(0.0)      # nothing hidden


def test_hidden_share_clamped():
    assert hidden_share(9.0, 10.0, 4.0) == 1.0     # real faster than satisfied: noise
    assert hidden_share(30.0, 10.0, 4.0) == 0.0    # exposed more than the copies took


@pytest.mark.parametrize("args", [(1.0, 1.0, 0.0), (1.0, 1.0, -1.0), (None, 1.0, 1.0),
                                  (1.0, None, 1.0), (1.0, 1.0, None), (math.nan, 1.0, 1.0),
                                  (1.0, 1.0, math.inf)])
def test_hidden_share_undefined_is_nan(args):
    assert math.isnan(hidden_share(*args))
    assert share_or_none(hidden_share(*args)) is None


def test_share_or_none_keeps_numbers():
    assert share_or_none(0.5) == 0.5
    assert share_or_none(0.0) == 0.0
