"""Whether a tensor holds only finite values, at the cost of one sum in the usual case."""

from __future__ import annotations

import torch


def all_finite(x: torch.Tensor) -> bool:
    """True when no entry is NaN or ±Inf. A sum is finite only if every entry is (NaN and Inf propagate
    through additions, and Inf − Inf is NaN), and costs about a twentieth of an elementwise test (measured:
    16 µs against 440 µs on 576², 0.24 against 3.3 ms on 1536², float32, 2 threads); the elementwise
    test runs only when the sum is not finite, which finite entries can also give by overflowing."""
    if not x.is_floating_point() or x.numel() == 0:
        return True
    values = x.float() if x.element_size() == 1 else x  # no float8 sum in torch
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())
