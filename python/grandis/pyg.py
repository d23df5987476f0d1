"""PyG graphs into grandis: a `Data` written in the layout `grandis data import --format
npy` reads (docs/guide.md, "Importing data"), then imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, List, Optional, Union

import numpy as np

from .client import GrandisError

PathLike = Union[str, os.PathLike]


def _numpy(value: Any) -> np.ndarray:
    """A tensor (torch, on any device) or array-like as a NumPy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def write_npy(data: Any, directory: PathLike) -> Path:
    """Writes `data.edge_index` (2 x E), `data.x` (N x F) and, when present, `data.y` and the
    `train_mask` / `val_mask` / `test_mask` (or `*_idx`) as the `.npy` files the importer
    reads. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    edge_index = getattr(data, "edge_index", None)
    x = getattr(data, "x", None)
    if edge_index is None or x is None:
        raise ValueError("from_pyg needs data.edge_index and data.x")
    edge_index = _numpy(edge_index)
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"data.edge_index must be 2 x E, got shape {edge_index.shape}")
    np.save(directory / "edge_index.npy", edge_index.astype(np.int64, copy=False))
    np.save(directory / "x.npy", _numpy(x).astype(np.float32, copy=False))
    y = getattr(data, "y", None)
    if y is not None:
        np.save(directory / "y.npy", _numpy(y).astype(np.int64, copy=False).reshape(-1))
    for split in ("train", "val", "test"):
        for attr in (f"{split}_mask", f"{split}_idx"):
            value = getattr(data, attr, None)
            if value is not None:
                np.save(directory / f"{split}_idx.npy", _numpy(value))
                break
    return directory


def from_pyg(
    data: Any,
    out: PathLike,
    symmetrize: bool = False,
    grandis_bin: Optional[PathLike] = None,
    extra_args: Optional[List[str]] = None,
) -> Path:
    """Writes a PyG `Data` (`edge_index`, `x`, `y`, masks) as `.npy` files and imports them
    into the dataset directory `out` with `grandis data import --format npy` (`grandis_bin`,
    else `$GRANDIS_BIN`, else `grandis` on the PATH). `symmetrize` adds the reverse of every
    edge (PyG's `to_undirected`). Raises `subprocess.CalledProcessError` carrying the
    importer's message when it refuses the arrays; `out` is then left as it was."""
    exe = str(grandis_bin or os.environ.get("GRANDIS_BIN") or shutil.which("grandis") or "")
    if not exe:
        raise FileNotFoundError("no grandis binary: pass grandis_bin or set GRANDIS_BIN")
    with tempfile.TemporaryDirectory(prefix="grandis-pyg-") as staging:
        write_npy(data, staging)
        cmd = [exe, "-q", "data", "import", "--format", "npy", "--input", staging,
               "--out", str(out)]
        if symmetrize:
            cmd.append("--symmetrize")
        cmd += list(extra_args or [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise GrandisError(f"grandis data import: {done.stderr.strip()}")
    return Path(out)
