"""What `kvscope` with no arguments and the notebook's `Explorer()` run: the bundled demo model under llama.cpp's parallel workload, with
settings that make the cache's behaviour show within seconds: a small cache shared by four clients whose
slots (112 positions each, as llama-server's) together claim more than its 256 cells. So sliding windows
slide (a 16-token window, where the model's own is 64; swa_full keeps the SWA cache shiftable), finished
requests free their cells, a client that fills its slot is context-shifted (its prompt kept, half of its
answer discarded; first at about step 40), and a slot search now and then fails and is retried with a
smaller batch (first at about step 38)."""
from __future__ import annotations

from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec

DEMO_SETTINGS = dict(n_ctx=256, pad=64, n_seq_max=5, kv_unified=True, n_batch=64, swa_window=16, swa_full=True)
DEMO_WORKLOAD = WorkloadSpec("parallel", n_clients=4, n_sequences=400, n_predict=80, arrival_gap=2, n_ctx_slot=112,
                             context_shift=True, n_keep=-1, sampler=dict(temperature=0.8, seed=1))


def demo_session(*, threaded: bool = True, steps_per_second: float = 8.0, threads: int | None = None) -> Session:
    """The demo session; steps_per_second: slow enough to watch (0: as fast as the machine goes);
    threads: torch's compute threads (None: torch's choice)."""
    return Session("demo", settings=DEMO_SETTINGS, workload=DEMO_WORKLOAD, threaded=threaded,
                   steps_per_second=steps_per_second, threads=threads)
