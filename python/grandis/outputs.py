"""What a distributed run's `--predict-dir` holds, put back in the dataset's vertex order.

Each global rank R writes `vertices.R.npy` (the dataset id of each of its rows: a partition
relabels vertices), `predictions.R.npy` (class ids, or logits with `--predict-logits`) and,
with `--predict-embeddings`, `embeddings.R.npy` (docs/guide.md, "Predicting")."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Union

import numpy as np

PathLike = Union[str, os.PathLike]


def read_predictions(directory: PathLike) -> np.ndarray:
    """The predictions of every vertex, row `v` for the dataset's vertex `v`: class ids
    (`int`), or one row of logits per vertex when the run wrote logits."""
    return _assemble(directory, "predictions")


def read_embeddings(directory: PathLike) -> np.ndarray:
    """The embedding of every vertex (the input of the model's last layer), row `v` for the
    dataset's vertex `v`."""
    return _assemble(directory, "embeddings")


def _ranks(directory: Path) -> List[int]:
    ranks = sorted(
        int(m.group(1))
        for name in os.listdir(directory)
        if (m := re.fullmatch(r"vertices\.(\d+)\.npy", name))
    )
    if not ranks:
        raise FileNotFoundError(
            f"{directory}: no vertices.R.npy files (is this a run's --predict-dir, "
            f"and did the run finish?)"
        )
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise ValueError(f"{directory}: the files of ranks {missing} are missing")
    return ranks


def _assemble(directory: PathLike, kind: str) -> np.ndarray:
    directory = Path(directory)
    ids, rows = [], []
    for r in _ranks(directory):
        v = np.load(directory / f"vertices.{r}.npy")
        path = directory / f"{kind}.{r}.npy"
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: missing (embeddings are written only with --predict-embeddings)"
                if kind == "embeddings"
                else f"{path}: missing"
            )
        x = np.load(path)
        if len(x) != len(v):
            raise ValueError(f"{path}: {len(x)} rows for the {len(v)} vertices of rank {r}")
        ids.append(v.astype(np.int64, copy=False))
        rows.append(x)
    ids_all = np.concatenate(ids)
    rows_all = np.concatenate(rows)
    n = len(ids_all)
    seen = np.zeros(n, dtype=bool)
    if n and (ids_all.min() < 0 or ids_all.max() >= n):
        raise ValueError(f"{directory}: vertex ids outside 0..{n} in vertices.R.npy")
    seen[ids_all] = True
    if not seen.all():
        raise ValueError(f"{directory}: the ranks' vertices repeat some ids and miss others")
    out = np.empty_like(rows_all)
    out[ids_all] = rows_all
    return out
