"""`Reuse`: buffers kept by size within a limit, a kept one handed out once, and let go when the working set changes."""

from __future__ import annotations

import numpy as np

from compress.quantizers.reuse import Reuse

MB = 1 << 20


def test_a_kept_buffer_is_handed_out_once_and_only_for_its_size():
    reuse = Reuse(limit=10 * MB)
    buffer = np.empty(4 * MB, np.uint8)
    reuse.keep(buffer)
    assert reuse.take(4 * MB + 1) is None and reuse.held == 4 * MB  # a miss that fits beside it keeps it
    assert reuse.take(4 * MB) is buffer and reuse.held == 0
    assert reuse.take(4 * MB) is None


def test_nothing_is_kept_past_the_limit_and_a_miss_that_would_not_fit_lets_all_go():
    reuse = Reuse(limit=10 * MB)
    for _ in range(3):
        reuse.keep(np.empty(4 * MB, np.uint8))
    assert reuse.held == 8 * MB  # the third would pass the limit
    assert reuse.take(3 * MB) is None and reuse.held == 0  # 8 + 3 > 10: a new working set
    assert reuse.take(4 * MB) is None


def test_no_limit_keeps_nothing_and_a_lower_limit_lets_go():
    reuse = Reuse()
    reuse.keep(np.empty(MB, np.uint8))
    assert reuse.held == 0
    reuse.set_limit(10 * MB)
    reuse.keep(np.empty(4 * MB, np.uint8))
    reuse.set_limit(2 * MB)
    assert reuse.held == 0 and reuse.take(4 * MB) is None
