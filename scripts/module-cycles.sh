#!/usr/bin/env bash
# No circle of imports between the modules of a crate (docs/ARCHITECTURE.md: modules in
# layers). Reads each crate's module graph with `cargo modules` (the cargo-modules crate,
# 0.27 on Rust 1.95: `cargo install cargo-modules --version 0.27.0 --locked`) and fails
# naming every circle of "uses" edges between modules. Functions, types and traits are left
# out of the graph: a method using its own type is no circle between modules (cargo-modules'
# own --acyclic counts those too, so it cannot serve as the check). Left out with them: what
# a function body reaches through a `crate::module::item` path, so import the item at the top
# of the module instead and the check sees it. Not part of .ci/run: the tool takes minutes to
# build.
#
#   scripts/module-cycles.sh [PACKAGE ...]   (default: the crates issue 36 names)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo modules --version >/dev/null 2>&1; then
    echo "cargo-modules is not installed: cargo install cargo-modules --version 0.27.0 --locked" >&2
    exit 2
fi
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(grandis-parallel grandis-cli grandis-wire grandis-quic grandis-store)
status=0
for p in "${packages[@]}"; do
    target=--lib
    [ "$p" = grandis-cli ] && target="--bin grandis"
    # shellcheck disable=SC2086
    cargo modules dependencies -p "$p" $target --no-fns --no-types --no-traits --no-externs \
        --no-sysroot 2>/dev/null | python3 -c '
import re, sys
edges = {}
for line in sys.stdin:
    m = re.match(r"\s*\"([^\"]+)\" -> \"([^\"]+)\" \[label=\"uses\"", line)
    if m:
        edges.setdefault(m.group(1), set()).add(m.group(2))
# Tarjan: every strongly connected set of more than one module is a circle.
index, low, stack, on, circles, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        part = []
        while True:
            w = stack.pop(); on.discard(w); part.append(w)
            if w == v: break
        if len(part) > 1: circles.append(sorted(part))
sys.setrecursionlimit(10000)
for v in list(edges):
    if v not in index: visit(v)
name = sys.argv[1]
if not edges:
    print(f"{name}: no module graph read"); sys.exit(1)
for c in circles:
    print(f"{name}: circle of imports: " + " <-> ".join(c))
print(f"{name}: {len(edges)} modules that import, {len(circles)} circles")
sys.exit(1 if circles else 0)
' "$p" || status=1
done
exit $status
