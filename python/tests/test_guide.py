"""The guide's Python example (docs/guide.md, "From Python"), run as written against the cluster
the guide starts for it (`grandis cluster up --serve`), with only its port and directory moved
to free ones. Without torch and torch_geometric the example runs up to `import torch`."""

import importlib.util
import re
import subprocess
import sys
import time

import requests

from conftest import REPO, free_port, grandis_bin

GUIDE = REPO / "docs" / "guide.md"


def guide_section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end]


def test_the_guides_python_example_runs_as_written(tmp_path):
    section = guide_section("From Python")
    shell = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    serve = next(line for line in shell.splitlines() if "cluster up --serve" in line)

    port, work = free_port(), tmp_path / "gc"
    moved = lambda s: (s.replace("127.0.0.1:7700", f"127.0.0.1:{port}")
                       .replace("--port 7700", f"--port {port}")
                       .replace("/tmp/gc", str(work)))
    args = moved(serve).rstrip(" &").split()
    assert args[0] == "grandis" and "--port" in args
    log = tmp_path / "cluster.log"
    cluster = subprocess.Popen([grandis_bin(), *args[1:]], stdout=open(log, "w"),
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving:" not in log.read_text():
            assert cluster.poll() is None, f"cluster up exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"cluster up is not serving:\n{log.read_text()}"
            time.sleep(0.1)
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).raise_for_status()

        code = moved(example)
        with_torch = all(importlib.util.find_spec(m) for m in ("torch", "torch_geometric"))
        if not with_torch:
            code = code[: code.index("import torch")]
        script = tmp_path / "example.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.split()
        assert lines[0] == "succeeded", out.stdout
        if with_torch:
            # The PyG model's classes are the ones grandis predicted, every vertex.
            assert float(lines[-1]) == 1.0, out.stdout
        assert (tmp_path / "model.safetensors").stat().st_size > 0
    finally:
        cluster.terminate()
        cluster.wait(timeout=30)
    assert cluster.returncode == 0, log.read_text()[-3000:]
    assert "stopping the cluster" in log.read_text()
