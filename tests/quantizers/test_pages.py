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


def test_a_large_buffer_is_reused_only_once_no_tensor_uses_it():
    reuse = pages.Reuse(limit=1 << 30)
    a = pages.empty((3000, 4096), torch.bfloat16, reuse)
    begin = a.data_ptr()
    assert begin % pages.ALIGN == 0
    view = a[10:20]
    del a
    assert reuse.held == 0  # a view still uses it
    b = pages.empty((3000, 4096), torch.bfloat16, reuse)
    assert b.data_ptr() != begin
    del view
    assert reuse.held == 3000 * 4096 * 2
    c = pages.empty((6000, 4096), torch.uint8, reuse)  # the same size in bytes, any dtype
    assert c.data_ptr() == begin and reuse.held == 0 and c.shape == (6000, 4096) and c.dtype == torch.uint8
    c.fill_(3)
    assert bool((c == 3).all())


def test_kept_buffers_are_bounded():
    reuse = pages.Reuse(limit=3 * pages.SMALLEST)
    tensors = [pages.empty((pages.SMALLEST,), torch.uint8, reuse) for _ in range(5)]
    del tensors
    assert reuse.held == 3 * pages.SMALLEST
    assert reuse.take(pages.SMALLEST) is not None and reuse.take(pages.SMALLEST + 1) is None
