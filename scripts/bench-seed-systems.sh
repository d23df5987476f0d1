#!/usr/bin/env bash
# The other seed systems' techniques against the exact runs they change, on the same graph,
# partition and seeds (issue "SANCUS staleness, DGS feature sampling, GraphTheta
# cluster-batches, ByteGNN partitioning"):
#
#   SANCUS   fb                  vs fb --staleness BOUND,MAX_SKIPS
#   DGS      cob, mb             vs the same with --remote-features FRACTION
#   cluster  --mode cluster      vs cob and mb (same batch size)
#
# Every run is `grandis train --json` with the inter-server link at 1/8 of the intra-server
# one (emulated); per row: inter-server bytes per epoch (halo + fetched features), median
# epoch seconds, test accuracy as the mean over the seeds, each as a ratio / difference
# against the exact row in the same invocation. ByteGNN's partitioning is measured by
# `grandis bench partition --sampling`.
#
# usage: scripts/bench-seed-systems.sh [DATASET_NAME=DIR ...]
#   default datasets: cora=data/cora, synth (20k vertices), s200k (the 200k bench graph)
# env: GRANDIS (binary, default target/release/grandis), SEEDS (default "0 1 2"),
#      EPOCHS_<name> (default 100 cora, 30 synth, 5 s200k), STALENESS (0.1,4),
#      REMOTE_FEATURES (0.5), BATCH (1024), INTRA_BW (400e6), WORK (a temp dir)
set -euo pipefail
G=${GRANDIS:-target/release/grandis}
SEEDS=${SEEDS:-"0 1 2"}
STALENESS=${STALENESS:-0.1,4}
REMOTE=${REMOTE_FEATURES:-0.5}
BATCH=${BATCH:-1024}
INTRA_BW=${INTRA_BW:-400e6}
INTER_BW=$(python3 -c "print(float('$INTRA_BW') / 8)")
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
[ -x "$G" ] || { echo "no grandis binary at $G (cargo build --release -p grandis-cli)" >&2; exit 1; }

declare -a DATASETS=("$@")
if [ ${#DATASETS[@]} -eq 0 ]; then
  [ -d "$WORK/synth" ] || "$G" --quiet data synth --nodes 20000 --avg-degree 15 --features 64 \
    --classes 8 --seed 1 --out "$WORK/synth" --force --json >/dev/null
  [ -d "$WORK/s200k" ] || "$G" --quiet data synth --nodes 200000 --avg-degree 20 --features 64 \
    --classes 16 --seed 1 --out "$WORK/s200k" --force --json >/dev/null
  DATASETS=("cora=data/cora" "synth=$WORK/synth" "s200k=$WORK/s200k")
fi

OUT="$WORK/runs.jsonl"
: >"$OUT"
run() { # name technique variant args...
  local name=$1 tech=$2 variant=$3; shift 3
  local dir=${DIR} epochs_var="EPOCHS_${name}"
  local default_epochs=30
  case $name in cora) default_epochs=100 ;; s200k) default_epochs=5 ;; esac
  local epochs=${!epochs_var:-$default_epochs}
  for seed in $SEEDS; do
    local line
    line=$("$G" --quiet train "$dir" --servers 2 --devices 2 --epochs "$epochs" --seed "$seed" \
      --eval-every 0 --intra-bandwidth "$INTRA_BW" --inter-bandwidth "$INTER_BW" --json "$@" \
      2>/dev/null | tail -1)
    printf '{"dataset":"%s","technique":"%s","variant":"%s","seed":%s,"summary":%s}\n' \
      "$name" "$tech" "$variant" "$seed" "$line" >>"$OUT"
  done
}

for spec in "${DATASETS[@]}"; do
  name=${spec%%=*}
  DIR=${spec#*=}
  echo "== $name ($DIR)" >&2
  run "$name" sancus "fb (exact)" --mode fb
  run "$name" sancus "fb --staleness $STALENESS" --mode fb --staleness "$STALENESS"
  for mode in cob mb; do
    args=(--mode "$mode" --batch-size "$BATCH" --sampling fanout --fanouts 15,10)
    run "$name" "dgs $mode" "$mode (exact)" "${args[@]}"
    run "$name" "dgs $mode" "$mode --remote-features $REMOTE" "${args[@]}" --remote-features "$REMOTE"
  done
  run "$name" cluster "cob" --mode cob --batch-size "$BATCH"
  run "$name" cluster "mb" --mode mb --batch-size "$BATCH"
  run "$name" cluster "cluster" --mode cluster --batch-size "$BATCH"
done

python3 - "$OUT" <<'EOF'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
groups = {}
for r in rows:
    groups.setdefault((r["dataset"], r["technique"]), {}).setdefault(r["variant"], []).append(r["summary"])
print("| dataset | technique | variant | inter-server bytes/epoch | vs first | epoch s | vs first | vertex-layers/epoch | test acc (mean of %d) | vs first |" % len(set(r["seed"] for r in rows)))
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
for (ds, tech), variants in groups.items():
    base = None
    for variant, runs in variants.items():
        inter = statistics.mean(s["halo_bytes_per_epoch"]["inter_server"] + s["fetch_bytes_per_epoch"]["inter_server"] for s in runs)
        epoch = statistics.mean(s["median_epoch_s"] for s in runs)
        acc = statistics.mean(s["test_acc"] for s in runs)
        vl = statistics.mean(s["computed_vertex_layers"] for s in runs)
        if base is None:
            base = (inter, epoch, acc)
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
        print(f"| {ds} | {tech} | {variant} | {inter:,.0f} | {ratio(inter, base[0])} | {epoch:.3f} | {ratio(epoch, base[1])} | {vl:,.0f} | {acc:.4f} | {100 * (acc - base[2]):+.1f} pt |")
EOF
