"""grandis from Python: jobs on a coordinator (:class:`Client`), a run's predictions and
embeddings as arrays in the dataset's vertex order (:func:`read_predictions`,
:func:`read_embeddings`), PyG graphs imported (:func:`from_pyg`) and a checkpoint as a PyG
module (:func:`to_pyg`, with `torch` and `torch_geometric` installed)."""

from .client import Client, GrandisError
from .dataset import read_graph
from .model import read_checkpoint, to_pyg
from .outputs import read_embeddings, read_predictions
from .pyg import from_pyg, write_npy

__all__ = [
    "Client",
    "GrandisError",
    "read_predictions",
    "read_embeddings",
    "from_pyg",
    "write_npy",
    "read_checkpoint",
    "to_pyg",
    "read_graph",
]
__version__ = "0.1.0"
