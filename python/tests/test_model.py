"""`to_pyg`: a checkpoint trained by grandis, loaded as PyG layers, gives grandis's logits.
Needs torch and torch_geometric (skipped without them)."""

import subprocess

import numpy as np
import pytest

import grandis

torch = pytest.importorskip("torch")
pytest.importorskip("torch_geometric")

@pytest.mark.parametrize(
    "model",
    [
        ["--model", "sage"],
        ["--model", "sage", "--norm", "layernorm", "--layers", "3"],
        ["--model", "gcn"],
        ["--model", "gat", "--heads", "2", "--output-heads", "2"],
        ["--model", "mlp"],
    ],
    ids=["sage", "sage-layernorm", "gcn", "gat", "mlp"],
)
def test_a_checkpoint_as_pyg_layers_gives_grandis_logits(cluster, tmp_path, model):
    ckpt, logits = tmp_path / "m.safetensors", tmp_path / "logits.npy"
    run = lambda *a: subprocess.run([cluster.bin, "-q", *a], check=True, capture_output=True)
    run("train", str(cluster.dataset), "--hidden", "8", "--epochs", "3", "--checkpoint",
        str(ckpt), *model)
    run("predict", str(cluster.dataset), "--checkpoint", str(ckpt), "--out", str(logits),
        "--logits")
    expected = np.load(logits)

    module = grandis.to_pyg(ckpt)
    assert not module.training
    edge_index, x = grandis.read_graph(cluster.dataset)
    with torch.no_grad():
        got = module(torch.from_numpy(x), torch.from_numpy(edge_index)).numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_what_is_not_a_checkpoint_is_refused(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(path))
    with pytest.raises(ValueError, match="not a grandis checkpoint"):
        grandis.to_pyg(path)
