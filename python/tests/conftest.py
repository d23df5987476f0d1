"""A real coordinator and two daemons (two servers on this machine, QUIC over loopback)
started from the built binary for the tests: no mock of the REST API."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]

TOKEN = "python-tests-token"
LABELS = ("py-a", "py-b")


def grandis_bin() -> str:
    exe = os.environ.get("GRANDIS_BIN") or str(REPO / "target" / "debug" / "grandis")
    if not Path(exe).is_file():
        pytest.exit(f"no grandis binary at {exe}: cargo build --bin grandis, or set GRANDIS_BIN")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited:\n{log.read_text()[-3000:]}")
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {seconds} s:\n{log.read_text()[-3000:]}")


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.bin = grandis_bin()
        self.procs = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = TOKEN

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        proc = subprocess.Popen(
            [self.bin, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def run(self, *args: str) -> None:
        subprocess.run([self.bin, "-q", *args], check=True, capture_output=True)

    def up(self) -> "Cluster":
        certs = self.root / "certs"
        self.run("certs", "init", "--out", str(certs), "--nodes", ",".join(LABELS), "--localhost")
        (self.root / "coordinator.toml").write_text(
            f'listen = "127.0.0.1:{self.port}"\n'
            f'db_path = "{self.root / "coordinator.redb"}"\n'
            f'token = "{TOKEN}"\n'
            f'daemon_ca = "{certs / "ca.pem"}"\n'
        )
        proc = self.start("coordinator", "coordinator", "--config", str(self.root / "coordinator.toml"))
        wait_http(f"{self.url}/healthz", proc, 30, self.root / "coordinator.log")
        for label in LABELS:
            mport = free_port()
            cfg = self.root / f"{label}.toml"
            cfg.write_text(
                f'coordinator = "{self.url}"\n'
                f'token = "{TOKEN}"\n'
                f'label = "{label}"\n'
                f"threads = 1\n"
                f'data_listen = "127.0.0.1:0"\n'
                f'cert_dir = "{certs}"\n'
                f'work_dir = "{self.root / ("work-" + label)}"\n'
                f'metrics_listen = "127.0.0.1:{mport}"\n'
            )
            proc = self.start(label, "daemon", "--config", str(cfg))
            wait_http(f"http://127.0.0.1:{mport}/healthz", proc, 30, self.root / f"{label}.log")
        # Both daemons registered and up before any test submits a two-server job.
        deadline = time.monotonic() + 30
        headers = {"Authorization": f"Bearer {TOKEN}"}
        while time.monotonic() < deadline:
            view = requests.get(f"{self.url}/v1/cluster", headers=headers, timeout=2).json()
            if sum(1 for d in view.get("daemons", []) if d.get("up")) == len(LABELS):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the daemons did not register: {view}")
        self.dataset = self.root / "data"
        self.run("data", "synth", "--nodes", "600", "--avg-degree", "6", "--features", "8",
                 "--classes", "4", "--out", str(self.dataset))
        return self

    def down(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c.up()
    finally:
        c.down()
