"""What holds for every cell of a cache whatever operations ran: llama.cpp's llama_kv_cells
(src/llama-kv-cells.h) clears pos, seq and shift together in `rm` and never leaves a positioned cell
without a sequence (`seq_rm` frees a cell when its last sequence goes)."""
from __future__ import annotations


def assert_cell_invariants(cells: list[tuple[int, frozenset[int], int]]) -> None:
    """cells: one stream's (pos, seq ids, shift) per cell, as `cache.cells(stream)` gives them."""
    for i, (pos, seqs, shift) in enumerate(cells):
        if pos < 0:
            assert (pos, seqs, shift) == (-1, frozenset(), 0), f"cell {i} is empty but holds {(pos, seqs, shift)}"
        else:
            assert seqs, f"cell {i} has position {pos} but no sequence"
