"""mars_core.engine.hugepages: the native kernels' weights copied into one buffer advised onto 2 MB pages."""
import sys
from pathlib import Path

import pytest
import torch

from mars_core.engine import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-127, 128, (960, 576), generator=g, dtype=torch.int8),
            torch.randn(77, 5, generator=g),
            torch.randint(-127, 128, (3072, 1536), generator=g, dtype=torch.int8)]


def test_gather_copies_every_tensor_into_one_buffer_unchanged(monkeypatch):
    monkeypatch.delenv("MARS_HUGE_PAGES", raising=False)
    src = _tensors()
    out, _ = hugepages.gather(src)
    for a, b in zip(src, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.is_contiguous() and b.data_ptr() % hugepages.ALIGN == 0
        assert b.data_ptr() != a.data_ptr()
    storage = {t.untyped_storage().data_ptr() for t in out}
    assert len(storage) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages to ask for here")
def test_gather_asks_for_huge_pages_where_the_kernel_has_them(monkeypatch):
    monkeypatch.delenv("MARS_HUGE_PAGES", raising=False)
    _, advised = hugepages.gather(_tensors())
    assert advised


def test_switched_off_it_leaves_the_tensors_where_they_are(monkeypatch):
    monkeypatch.setenv("MARS_HUGE_PAGES", "0")
    src = _tensors()
    out, advised = hugepages.gather(src)
    assert not advised and all(a is b for a, b in zip(src, out))


def test_small_sets_are_copied_but_not_advised(monkeypatch):
    monkeypatch.delenv("MARS_HUGE_PAGES", raising=False)
    src = [torch.arange(10, dtype=torch.int8)]
    out, advised = hugepages.gather(src)
    assert not advised and torch.equal(out[0], src[0])
