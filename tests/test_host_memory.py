"""Large weights are advised into huge pages in place (engine/models/host_memory.py): the same tensor
and values, its memory marked for huge pages; small tensors and other devices are left alone."""
import sys
from pathlib import Path

import pytest
import torch

from engine.models import host_memory
from engine.models.host_memory import HUGE_PAGE_MIN_BYTES, advise_huge_pages, huge_page_range

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_usable = pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                                reason="transparent huge pages are off or not Linux")


def mapping_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address addr."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= addr < hi
            if inside:
                fields = {"range": head}
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux only")
def test_the_range_covers_whole_huge_pages_inside_the_tensor_only():
    t = torch.empty(3 * 1024 * 1024, dtype=torch.float32)  # 12 MiB
    start, length = huge_page_range(t)
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and length > 0
    assert begin <= start and start + length <= end and start - begin < (2 << 20) and end - (start + length) < (2 << 20)
    assert huge_page_range(torch.empty(HUGE_PAGE_MIN_BYTES // 4 - 1)) is None  # under the threshold
    assert huge_page_range(torch.empty(0)) is None


def test_advice_changes_neither_the_tensor_nor_its_values():
    t = torch.randn(1200, 1024)  # 4.7 MiB
    before = t.clone()
    assert advise_huge_pages(t) is t
    assert torch.equal(t, before)
    view = t[100:]  # a view advises its whole storage; still the same values
    assert advise_huge_pages(view) is view and torch.equal(t, before)


@thp_usable
def test_the_memory_is_marked_for_huge_pages():
    """smaps marks a mapping THPeligible when huge pages may back it; after the advice the range of a
    torch allocation is. (Before it, it may be already: the allocator may hand out memory numpy advised
    earlier in the process, so that is not asserted.)"""
    t = torch.empty(4 * 1024 * 1024, dtype=torch.float32).fill_(1.0)  # 16 MiB
    start, _ = huge_page_range(t)
    advise_huge_pages(t)
    assert mapping_of(start).get("THPeligible") == "1"
    assert t.sum().item() == t.numel()


@thp_usable
def test_a_models_large_matrices_are_marked_and_give_the_same_logits(monkeypatch):
    """The fused gate/up matrix torch makes at load is advised (and the embedding, the tied output
    layer); the logits are those of the same weights left as they were."""
    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    size = dict(n_embd=256, head_dim=64, n_ff=2048, n_vocab=8192)  # gate/up: 4 MiB, embedding: 8 MiB
    monkeypatch.setattr(host_memory, "HUGE_PAGE_MIN_BYTES", 1 << 60)  # nothing advised
    plain = in_memory_model(**size)
    monkeypatch.setattr(host_memory, "HUGE_PAGE_MIN_BYTES", 4 << 20)
    huge = in_memory_model(**size)
    for t in (huge.transformer.layers[0].w_gate_up, huge.transformer.tok_embd):
        start, _ = huge_page_range(t)
        assert mapping_of(start).get("THPeligible") == "1"
    logits = []
    for model in (plain, huge):
        ctx = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
        assert ctx.decode(Batch.for_sequence([1, 2, 3, 4], 0, 0)) == 0
        logits.append(ctx.logits(-1))
    assert torch.equal(logits[0], logits[1])
