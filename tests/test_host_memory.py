"""Large weights live in memory advised for huge pages (engine/models/host_memory.py): the same values,
in a mapping the kernel may back with 2 MiB pages; small tensors and tensors in an autograd graph are
left as they are."""
import sys
from pathlib import Path

import pytest
import torch

from engine.models import host_memory
from engine.models.host_memory import HUGE_PAGE_MIN_BYTES, huge_page_empty, into_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_usable = pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                                reason="transparent huge pages are off or not Linux")


def mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds t's first byte."""
    addr = t.data_ptr()
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


def test_a_large_tensor_is_copied_with_its_values_and_shape():
    t = torch.randn(1200, 1024)  # 4.9 MB
    h = into_huge_pages(t)
    assert h.data_ptr() != t.data_ptr() and h.is_contiguous()
    assert h.shape == t.shape and h.dtype == t.dtype and torch.equal(h, t)
    h2 = into_huge_pages(t.t())  # a strided source arrives contiguous, values in their places
    assert h2.is_contiguous() and torch.equal(h2, t.t())


def test_small_and_trained_tensors_stay_as_they_are():
    small = torch.randn(64, 64)
    assert into_huge_pages(small).data_ptr() == small.data_ptr()
    trained = torch.randn(1200, 1024, requires_grad=True)
    assert into_huge_pages(trained) is trained
    assert huge_page_empty((8, 8), torch.float32).untyped_storage().nbytes() == 256


def test_the_memory_outlives_every_name_but_the_tensor():
    """The mapping is kept alive by the tensor (and by views of it), not by any other reference."""
    import gc

    h = into_huge_pages(torch.arange(HUGE_PAGE_MIN_BYTES // 4 + 10, dtype=torch.float32))
    view = h[5:].view(-1)
    del h
    gc.collect()
    assert view[0].item() == 5.0 and view[-1].item() == HUGE_PAGE_MIN_BYTES // 4 + 9
    view.add_(1)  # writable
    assert view[0].item() == 6.0


@thp_usable
def test_the_copy_is_in_a_mapping_advised_for_huge_pages():
    """smaps marks a mapping THPeligible when huge pages may back it: the copy's is."""
    h = into_huge_pages(torch.randn(1200, 1024))
    fields = mapping_of(h)
    assert fields.get("THPeligible") == "1", fields


@thp_usable
def test_a_models_large_matrices_are_in_huge_page_memory(monkeypatch):
    """Weights over the threshold go to advised mappings (the threshold moved to compare); the model's logits are the ones the same weights in ordinary memory give."""
    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    size = dict(n_embd=256, head_dim=64, n_ff=2048, n_vocab=4096)  # gate/up: 2 * 2048 * 256 * 4 bytes
    monkeypatch.setattr(host_memory, "HUGE_PAGE_MIN_BYTES", 1 << 60)  # nothing copied
    plain = in_memory_model(**size)
    monkeypatch.setattr(host_memory, "HUGE_PAGE_MIN_BYTES", 1 << 20)
    huge = in_memory_model(**size)
    assert mapping_of(huge.transformer.layers[0].w_gate_up).get("THPeligible") == "1"
    assert mapping_of(huge.transformer.tok_embd).get("THPeligible") == "1"  # 4 MiB, also the output layer
    if "[madvise]" in THP.read_text():
        assert mapping_of(plain.transformer.layers[0].w_gate_up).get("THPeligible") == "0"
    logits = []
    for model in (plain, huge):
        ctx = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
        assert ctx.decode(Batch.for_sequence([1, 2, 3, 4], 0, 0)) == 0
        logits.append(ctx.logits(-1))
    assert torch.equal(logits[0], logits[1])
