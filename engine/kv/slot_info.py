"""Where a ubatch goes (llama.cpp's slot_info): what find_slot returns and apply_ubatch and the
attention inputs take, kept apart from the cache so that neither of those depends on the other."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class SlotInfo:
    """For each token group of a ubatch, its stream and one cell index per token."""

    streams: tuple[int, ...]
    idxs: tuple[np.ndarray, ...]

    @property
    def n_per_stream(self) -> int:
        return len(self.idxs[0])
