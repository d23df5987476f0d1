"""A grandis dataset directory read back as NumPy arrays: its graph as PyG's `edge_index` and
its features, for `to_pyg` models and any other PyTorch code.

Each array file is a 64-byte header (magic `GRNDSARR`, version, dtype code, rows, cols, a
checksum; docs/ARCHITECTURE.md, "store") and the little-endian payload."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple, Union

import numpy as np

HEADER_BYTES = 64
MAGIC = b"GRNDSARR"

PathLike = Union[str, os.PathLike]


def read_array(path: PathLike, dtype: str) -> np.ndarray:
    """One headered array file, memory-mapped (`rows x cols`, or `rows` when one column)."""
    path = Path(path)
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:8] != MAGIC:
        raise ValueError(f"{path}: not a grandis array file (no {MAGIC.decode()} header)")
    rows = int.from_bytes(header[16:24], "little")
    cols = int.from_bytes(header[24:32], "little")
    want = HEADER_BYTES + rows * max(cols, 1) * np.dtype(dtype).itemsize
    if path.stat().st_size != want:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, its header says {want}")
    shape = (rows, cols) if cols > 1 else (rows,)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=shape)


def read_graph(dataset: PathLike) -> Tuple[np.ndarray, np.ndarray]:
    """`(edge_index, x)` of a dataset: `edge_index` as PyG takes it (2 x E, int64; row 0 the
    sources, row 1 the destinations of the edges each vertex aggregates over) and `x` the
    features (N x F, float32)."""
    dataset = Path(dataset)
    offsets = np.asarray(read_array(dataset / "graph.offsets", "<u8"), dtype=np.int64)
    sources = read_array(dataset / "graph.indices", "<u4")
    n = len(offsets) - 1
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    edge_index = np.stack([np.asarray(sources, dtype=np.int64), dst])
    x = np.asarray(read_array(dataset / "features.f32", "<f4"), dtype=np.float32)
    return edge_index, x.reshape(n, -1)
