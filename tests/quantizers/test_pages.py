"""`pages.empty`: an ordinary tensor, with every whole 2 MB page inside a large one (and nothing outside it) marked."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers import pages


@pytest.mark.parametrize("shape, dtype", [((3000, 4096), torch.uint8), ((1025, 4097), torch.bfloat16), ((10, 10), torch.float32)])
def test_whole_huge_pages_inside_a_large_buffer_are_marked(monkeypatch, shape, dtype):
    calls = []
    monkeypatch.setattr(pages, "_madvise", lambda: lambda start, length, advice: calls.append((start, length, advice)))
    t = pages.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    begin, size = t.data_ptr(), t.numel() * t.element_size()
    if size < pages.SMALLEST:
        assert calls == []
        return
    [(start, length, advice)] = calls
    assert advice == pages.MADV_HUGEPAGE and start % pages.HUGE_PAGE == 0 and length % pages.HUGE_PAGE == 0
    assert begin <= start < begin + pages.HUGE_PAGE  # the first whole huge page ...
    assert begin + size - pages.HUGE_PAGE < start + length <= begin + size  # ... to the last, inside the buffer
    t.fill_(7)
    assert bool((t == 7).all())


def test_without_the_mark_the_buffer_is_an_ordinary_one(monkeypatch):
    monkeypatch.setattr(pages, "_madvise", lambda: None)
    t = pages.empty((4096, 4096), torch.float32)
    assert t.shape == (4096, 4096) and t.dtype == torch.float32
