#!/usr/bin/env python3
"""Floods a running coordinator with idle TCP connections and reports what it costs it.

    scripts/flood-coordinator.py --addr 127.0.0.1:7700 --pid PID [--connections 20000]

Opens CONNECTIONS connections that never send a byte (as a scanner or an attacker would), in
batches, checking /healthz after each batch; then closes them all. Prints the coordinator's
resident memory (VmRSS of PID) and open file descriptors before, at the peak and 5 s after,
and the slowest /healthz answer during the flood. The coordinator must keep answering
/healthz (its connection cap evicts never-used connections) and its memory must come back.
"""

import argparse
import os
import resource
import socket
import time


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def healthz(host, port):
    t = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = s.recv(64)
    if not reply.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"/healthz answered {reply!r}")
    return time.monotonic() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--connections", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=1000)
    a = ap.parse_args()
    host, port = a.addr.rsplit(":", 1)
    port = int(port)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, a.connections + 1000), hard))

    print(f"before: rss {rss_mib(a.pid):.1f} MiB, fds {fds(a.pid)}, healthz {healthz(host, port)*1e3:.1f} ms")
    socks, refused, slowest, peak_rss, peak_fds = [], 0, 0.0, 0.0, 0
    while len(socks) + refused < a.connections:
        for _ in range(min(a.batch, a.connections - len(socks) - refused)):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect((host, port))
            except BlockingIOError:
                pass
            except OSError:
                refused += 1
                s.close()
                continue
            socks.append(s)
        slowest = max(slowest, healthz(host, port))
        peak_rss = max(peak_rss, rss_mib(a.pid))
        peak_fds = max(peak_fds, fds(a.pid))
    print(f"flood: {len(socks)} connections opened ({refused} refused locally), "
          f"peak rss {peak_rss:.1f} MiB, peak fds {peak_fds}, slowest healthz {slowest*1e3:.1f} ms")
    for s in socks:
        s.close()
    time.sleep(5)
    print(f"after: rss {rss_mib(a.pid):.1f} MiB, fds {fds(a.pid)}, healthz {healthz(host, port)*1e3:.1f} ms")


if __name__ == "__main__":
    main()
