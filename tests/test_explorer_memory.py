"""The notebook explorer's memory bars, without a browser: each device's parts and free space are the
watch layer's device rows, virtual devices are labelled, and a rebuild onto a virtual GPU moves the bars."""
from __future__ import annotations

import pytest

pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")

from engine.runners.session import Session  # noqa: E402
from engine.watch.device_mirror import PARTS  # noqa: E402
from explorer.memory import MemoryBars, mib  # noqa: E402

SETTINGS = dict(n_ctx=256, pad=64, n_seq_max=2, kv_unified=True, swa_full=True)


def bars_of(bars: MemoryBars) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for trace in bars.figure.data:
        for label, x in zip(trace.y, trace.x):
            out.setdefault(label, {})[trace.name] = x
    return out


def test_bars_follow_the_devices_through_a_rebuild_onto_a_virtual_gpu():
    with Session("demo", settings=SETTINGS, threaded=False) as session:
        bars = MemoryBars.of(session, widget=False)
        shown = bars_of(bars)
        assert list(shown) == ["CPU"] and shown["CPU"]["free"] == 0  # the host: no limit, no free part
        rows = bars.watcher.mirror.devices.rows
        assert shown["CPU"]["K/V"] == pytest.approx(mib(rows["CPU"].bytes["kv"])) and shown["CPU"]["K/V"] > 0
        assert "layers CCCCCC" in bars.figure.layout.title.text

        session.rebuild(**SETTINGS, devices=["VGPU0=64MiB"], n_gpu_layers=-1).result()
        bars.update()
        shown = bars_of(bars)
        assert "VGPU0 (virtual)" in shown
        vgpu = bars.watcher.mirror.devices.rows["VGPU0"]
        assert vgpu.bytes["weights"] > 0
        assert shown["VGPU0 (virtual)"]["weights"] == pytest.approx(mib(vgpu.bytes["weights"]))
        parts = sum(shown["VGPU0 (virtual)"][name] for name in ("weights", "K/V", "compute"))
        assert parts + shown["VGPU0 (virtual)"]["free"] == pytest.approx(64.0)  # the capacity, all told
        assert "layers GGGGGG" in bars.figure.layout.title.text
        assert len(bars.figure.data) == len(PARTS) + 1


def test_a_servers_host_memory_is_named_only_when_held():
    from engine.runners.session import Session
    from engine.runners.workloads import WorkloadSpec

    spec = WorkloadSpec(kind="server", n_clients=2, sampler={"temperature": 0.0})
    with Session("demo", settings=dict(n_ctx=2048, n_seq_max=2), workload=spec, threaded=False) as session:
        bars = MemoryBars.of(session, widget=False)
        legend = {trace.name for trace in bars.figure.data if trace.showlegend is not False}
        assert {"checkpoints", "prompt cache"}.isdisjoint(legend) and "K/V" in legend
        session.step(400).result()
        bars.update()
        legend = {trace.name for trace in bars.figure.data if trace.showlegend is not False}
        assert {"checkpoints", "prompt cache"} <= legend
        cpu = bars.watcher.mirror.devices.rows["CPU"]
        assert cpu.bytes["checkpoints"] > 0
        assert bars_of(bars)["CPU"]["checkpoints"] == pytest.approx(mib(cpu.bytes["checkpoints"]))
