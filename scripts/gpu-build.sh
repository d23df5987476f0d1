#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain: the
# `grandis` binary and the CUDA test binaries, release, with `--features cuda`, stripped, in
# one folder (default .gpu/, which is small enough to carry: about 30 MB).
#
#   scripts/gpu-build.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
mkdir -p "$dir"
cargo build --release --features cuda -p grandis-cli
cp target/release/grandis "$dir/grandis"
# Test binaries: name them by target (cargo adds a hash to the file name).
cargo test --release --no-run --message-format=json \
    -p grandis-engine -p grandis-trainer --features grandis-engine/cuda,grandis-trainer/cuda \
    --test cuda_parity --test cuda_models --test train --test link |
    python3 -c '
import json, sys, shutil
names = {"cuda_parity": "cuda_parity", "cuda_models": "cuda_models", "train": "trainer_train", "link": "trainer_link"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in names:
        shutil.copy(m["executable"], sys.argv[1] + "/" + names[m["target"]["name"]])
        print("built", names[m["target"]["name"]])
' "$dir"
strip "$dir"/*
ls -la "$dir"
