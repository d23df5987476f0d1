"""The Python package against a real coordinator and daemons (conftest.py)."""

import types

import numpy as np
import pytest
from safetensors.numpy import load_file

import grandis


def client(cluster):
    return grandis.Client(cluster.url, token=cluster.token)


def small_job(cluster, **extra):
    spec = {
        "name": "python",
        "dataset": str(cluster.dataset),
        "mode": "fb",
        "layers": 2,
        "hidden": 8,
        "epochs": 2,
        "servers": 2,
        "devices": 1,
        "checkpoint_every": 1,
    }
    spec.update(extra)
    return spec


def test_a_job_is_submitted_followed_and_read_back(cluster, tmp_path):
    c = client(cluster)
    out = tmp_path / "predictions"
    job = c.submit(small_job(cluster, predict={"dir": str(out)}))
    assert job["state"] in ("queued", "assigned", "running")
    epochs, states = [], []
    final = c.follow(job["id"], progress=False, on_epoch=epochs.append, on_state=states.append)
    assert final["state"] == "succeeded", final
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert all(np.isfinite(e["loss"]) for e in epochs)
    assert states and states[0]["id"] == job["id"]
    assert c.job(job["id"])["state"] == "succeeded"
    assert job["id"] in [j["id"] for j in c.jobs()]

    # The ranks' files in dataset order: every vertex once, a class id each.
    pred = grandis.read_predictions(out)
    assert pred.shape == (600,)
    assert pred.min() >= 0 and pred.max() < 4
    ids = np.concatenate([np.load(out / f"vertices.{r}.npy") for r in range(2)])
    rows = np.concatenate([np.load(out / f"predictions.{r}.npy") for r in range(2)])
    assert np.array_equal(pred[ids], rows)

    ckpt = tmp_path / "model.safetensors"
    assert c.download_checkpoint(job["id"], ckpt) == 2
    tensors = load_file(str(ckpt))
    assert tensors and all(np.isfinite(t).all() for t in tensors.values())


def test_a_toml_job_file_is_submitted_as_toml(cluster, tmp_path):
    c = client(cluster)
    path = tmp_path / "job.toml"
    path.write_text(
        f'dataset = "{cluster.dataset}"\nmode = "fb"\nlayers = 2\nhidden = 8\n'
        f"epochs = 1\nservers = 2\ndevices = 1\n"
    )
    job = c.submit(path)
    assert c.wait(job["id"], timeout=120)["state"] == "succeeded"


def test_errors_carry_the_coordinators_message(cluster):
    c = client(cluster)
    with pytest.raises(grandis.GrandisError) as bad:
        c.submit(small_job(cluster, epochs=0, hidden=0))
    e = bad.value
    assert e.status in (400, 422) and e.code
    named = {f["field"] for f in e.fields}
    assert {"epochs", "hidden"} <= named, e.fields
    assert "epochs" in str(e)

    with pytest.raises(grandis.GrandisError) as missing:
        c.job(987654)
    assert missing.value.status == 404

    with pytest.raises(grandis.GrandisError) as unauthorized:
        grandis.Client(cluster.url, token="wrong").jobs()
    assert unauthorized.value.status == 401

    with pytest.raises(grandis.GrandisError) as unreachable:
        grandis.Client("http://127.0.0.1:9", timeout=2).jobs()
    assert unreachable.value.status is None


def test_a_cancelled_job_ends_cancelled_and_cannot_be_cancelled_twice(cluster):
    c = client(cluster)
    job = c.submit(small_job(cluster, epochs=100000, checkpoint_every=None))
    cancelled = c.cancel(job["id"])
    assert cancelled["state"] == "cancelled"
    assert c.follow(job["id"], progress=False)["state"] == "cancelled"
    with pytest.raises(grandis.GrandisError) as again:
        c.cancel(job["id"])
    assert again.value.status == 409


def test_the_cluster_view_lists_both_servers(cluster):
    view = client(cluster).cluster()
    assert sorted(d["label"] for d in view["daemons"]) == ["py-a", "py-b"]


def test_prediction_files_with_a_rank_missing_are_refused(tmp_path):
    for r in (0, 2):
        np.save(tmp_path / f"vertices.{r}.npy", np.array([r], dtype=np.int64))
        np.save(tmp_path / f"predictions.{r}.npy", np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match=r"ranks \[1\]"):
        grandis.read_predictions(tmp_path)
    with pytest.raises(FileNotFoundError):
        grandis.read_predictions(tmp_path / "nowhere")


def test_a_pyg_like_graph_is_imported(cluster, tmp_path):
    rng = np.random.default_rng(0)
    n = 50
    src = rng.integers(0, n, 200)
    dst = rng.integers(0, n, 200)
    mask = np.zeros(n, dtype=bool)
    mask[:20] = True
    data = types.SimpleNamespace(
        edge_index=np.stack([src, dst]),
        x=rng.normal(size=(n, 5)).astype(np.float32),
        y=rng.integers(0, 3, n),
        train_mask=mask,
        val_mask=~mask & (np.arange(n) < 35),
        test_mask=np.arange(n) >= 35,
    )
    out = grandis.from_pyg(data, tmp_path / "g", symmetrize=True, grandis_bin=cluster.bin)
    assert (out / "dataset.json").is_file()

    data.edge_index = np.stack([src, np.full(200, n + 7)])  # an id past the last vertex
    with pytest.raises(grandis.GrandisError, match="edge_index"):
        grandis.from_pyg(data, tmp_path / "bad", grandis_bin=cluster.bin)
    assert not (tmp_path / "bad").exists()


def test_a_dataset_reads_back_as_edge_index_and_features(cluster, tmp_path):
    edge_index, x = grandis.read_graph(cluster.dataset)
    assert x.shape == (600, 8) and x.dtype == np.float32
    assert edge_index.shape[0] == 2 and edge_index.dtype == np.int64
    assert edge_index.min() >= 0 and edge_index.max() < 600
    bad = tmp_path / "graph.offsets"
    bad.write_bytes(b"not an array")
    with pytest.raises(ValueError, match="not a grandis array file"):
        grandis.read_graph(tmp_path)
