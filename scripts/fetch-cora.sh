#!/usr/bin/env bash
# Fetches Cora and imports it as a grandis dataset.
#
# Usage: scripts/fetch-cora.sh DIR [RAW_DIR]
#
# Cora comes from the Neo4j `graphdatascience` Python package (version 2.2), which ships the
# dataset as two gzip-compressed Parquet tables (cora_nodes.parquet.gzip and
# cora_rels.parquet.gzip). The wheel is fetched with pip from the Python package index (no
# dependencies, nothing installed), the two tables are unpacked into RAW_DIR (default:
# DIR-raw) and checked against known SHA-256 sums, and then imported into DIR with
# `grandis data import --format parquet --symmetrize`: 2,708 vertices, 10,556 directed edges,
# 1,433 features, 7 classes, and a seeded 20-per-class/500/1000 split.
#
# Idempotent: the download is skipped when RAW_DIR already holds the verified tables, and the
# import is skipped when DIR already verifies as a grandis dataset.
#
# The grandis binary is $GRANDIS_BIN if set, else `grandis` on PATH, else
# `cargo run --release -p grandis-cli --`.
set -euo pipefail

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 1 || $# -gt 2 ]]; then
    usage >&2
    exit 2
fi
DIR=${1%/}
RAW=${2:-$DIR-raw}
RAW=${RAW%/}
VERSION=2.2
declare -A SHA256=(
    [cora_nodes.parquet.gzip]=c54c0625af98570287dcb25e9f29e0b229948352a8de1dbf202fa39f36bfe591
    [cora_rels.parquet.gzip]=e0059f81e607c0262e93fbe3c77950b06098dab167f0071cba97a82c9440ca01
)

if [[ -n "${GRANDIS_BIN:-}" ]]; then
    grandis=("$GRANDIS_BIN")
elif command -v grandis >/dev/null 2>&1; then
    grandis=(grandis)
else
    root=$(cd "$(dirname "$0")/.." && pwd)
    grandis=(cargo run --quiet --release --manifest-path "$root/Cargo.toml" -p grandis-cli --)
fi

raw_ok() {
    local f
    for f in "${!SHA256[@]}"; do
        [[ -f "$1/$f" ]] || return 1
        echo "${SHA256[$f]}  $1/$f" | sha256sum --check --status || return 1
    done
}

if raw_ok "$RAW"; then
    echo "fetch-cora: $RAW already holds the Cora tables"
else
    command -v python3 >/dev/null || { echo "fetch-cora: python3 (with pip) is required" >&2; exit 1; }
    command -v unzip >/dev/null || { echo "fetch-cora: unzip is required" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "fetch-cora: downloading the graphdatascience==$VERSION wheel"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --ignore-requires-python \
        --dest "$tmp" "graphdatascience==$VERSION"
    wheel=$(ls "$tmp"/graphdatascience-"$VERSION"-*.whl)
    unzip -q -o -j "$wheel" 'graphdatascience/resources/cora/*.parquet.gzip' -d "$tmp/raw"
    if ! raw_ok "$tmp/raw"; then
        echo "fetch-cora: the tables in $wheel do not match the expected SHA-256 sums" >&2
        exit 1
    fi
    # Each table is moved into place whole (a rename), so an interrupted run never leaves a
    # half-written table; a later run checks the sums again.
    mkdir -p "$RAW"
    for f in "${!SHA256[@]}"; do
        mv -f "$tmp/raw/$f" "$RAW/$f"
    done
    echo "fetch-cora: unpacked the Cora tables into $RAW"
fi

if "${grandis[@]}" --quiet data verify "$DIR" >/dev/null 2>&1; then
    echo "fetch-cora: $DIR is already a valid dataset"
    exit 0
fi
if [[ -e "$DIR" && ! -f "$DIR/dataset.json" ]]; then
    echo "fetch-cora: $DIR exists and is not a grandis dataset; not replacing it" >&2
    exit 1
fi
# --force: a dataset at DIR that does not verify is replaced (atomically, by the importer).
"${grandis[@]}" data import --format parquet --input "$RAW" --out "$DIR" --symmetrize \
    --name cora --seed 0 --force
