#!/usr/bin/env bash
# Every check that needs a GPU, in one command, on a machine with an NVIDIA driver and no Rust
# toolchain. Build here first (scripts/gpu-build.sh puts the stripped `grandis` binary and the
# CUDA test binaries in BIN_DIR), then on the GPU machine:
#
#   scripts/gpu-check.sh [--bin-dir DIR] [--out DIR] [STEP...]
#
# Steps (default: info parity cli):
#   info    the device, the driver and where the CUDA libraries were found
#   parity  every backend op against the CPU backend (1e-5 relative, TF32 off) and SAGE, GCN
#           and ResSAGE+ (28 layers) for 10 epochs on a synthetic graph and on Cora
#           (losses within 1e-3 relative); needs data/cora for the Cora half; link
#           prediction (both decoders, with learnable embeddings) against the CPU
#   cli     `grandis train --device cuda:N`: the device line, and one clear line for a wrong
#           ordinal
#   bench   full-batch 3-layer SAGE (hidden 256) on a products-scale synthetic graph against
#           PyG on the same GPU (CSR adj_t and edge_index, or BENCH_PYG_ADJ), in one `grandis
#           bench train`; BENCH_BASELINE=BIN runs an earlier build right after
#   modes   --mode mb and --mode cob (fanouts 15,10,5, batch 1024) on the same graph, training
#           steps only; MODES_BASELINE=BIN runs an earlier build after each, MODES_ARGS adds flags
#   ranks   fb, flx (every k), cob and mb, 2 servers x 2 ranks sharing the GPU (no sampling),
#           against the same runs on CPU threads: per-epoch losses within 1e-4 relative, and
#           the single-GPU full-batch epoch (RANKS_NODES vertices, default 20000); the ranks
#           use device copies; then fb on one rank with NCCL inside and between servers; then
#           `cluster up --device cuda:0` (two daemon processes x 2 ranks) for fb and cob
#   links   link prediction on the GPU: `bench train --task link` against PyG on the same GPU
#           (Cora, GCN 128/64, 3 seeds; Last.fm with learnable embeddings; a LINKS_NODES-vertex
#           synthetic graph, default 200000), then fb, flx, mb and cob link runs with 2 servers x
#           2 ranks on the GPU against the same runs on CPU threads (losses within 1e-4), learnable
#           embeddings sharded across the ranks included
# Output of each step goes to stdout and to OUT/STEP.log.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN_DIR=.gpu
OUT_DIR=${OUT:-/tmp/grandis-gpu-check}
STEPS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) BIN_DIR=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) STEPS+=("$1"); shift ;;
    esac
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=(info parity cli)
# Datasets and per-run JSON go to a scratch folder: OUT_DIR keeps one log per step, small
# enough to copy back from a lent machine.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/grandis-gpu-check.XXXXXX")
mkdir -p "$OUT_DIR"
GRANDIS="$BIN_DIR/grandis"
[ -x "$GRANDIS" ] || { echo "no grandis binary at $GRANDIS (run scripts/gpu-build.sh)" >&2; exit 2; }

# cudarc opens libnvrtc, libcublas and libnccl by file name. They live in the CUDA toolkit
# and in the nvidia-* Python wheels; put every such folder on the loader path, and give
# NCCL's versioned file the plain name cudarc also tries.
lib_dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && lib_dirs+=("$d")
done
if py_nvidia=$(python3 -c 'import nvidia, os; print(os.pathsep.join(nvidia.__path__))' 2>/dev/null); then
    IFS=: read -r -a roots <<<"$py_nvidia"
    while IFS= read -r d; do lib_dirs+=("$d"); done < <(
        find "${roots[@]}" -name 'lib*.so*' \( -name 'libnvrtc*' -o -name 'libcublas*' -o -name 'libnccl*' \) \
            -printf '%h\n' 2>/dev/null | sort -u)
fi
shim=$(mktemp -d)
for d in "${lib_dirs[@]}"; do
    if [ -e "$d/libnccl.so.2" ] && [ ! -e "$shim/libnccl.so" ]; then ln -s "$d/libnccl.so.2" "$shim/libnccl.so"; fi
done
LD_LIBRARY_PATH="$shim:$(IFS=:; echo "${lib_dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH GRANDIS_REQUIRE_GPU=1 RUST_BACKTRACE=1

failed=()
run_step() {
    local name=$1; shift
    printf '\n=== %s (%s)\n' "$name" "$(date +%T)"
    if "$@" 2>&1 | tee "$OUT_DIR/$name.log"; then
        echo "=== $name: ok"
    else
        echo "=== $name: FAILED"
        failed+=("$name")
    fi
}

step_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    echo "library folders: ${lib_dirs[*]}"
    for l in libcuda.so libnvrtc.so libcublas.so libnccl.so; do
        echo "$l: $(ldconfig -p | grep -m1 "$l" | awk '{print $NF}') $(for d in "$shim" "${lib_dirs[@]}"; do ls "$d"/$l* 2>/dev/null; done | head -2 | tr '\n' ' ')"
    done
    python3 -c 'import torch, torch_geometric; print("torch", torch.__version__, "cuda", torch.version.cuda, "pyg", torch_geometric.__version__)'
}

step_parity() {
    local ok=0
    "$BIN_DIR/cuda_parity" --test-threads=1 --nocapture || ok=1
    GRANDIS_CORA=${GRANDIS_CORA:-data/cora} "$BIN_DIR/cuda_models" --test-threads=1 --nocapture || ok=1
    "$BIN_DIR/trainer_train" cuda --nocapture || ok=1
    "$BIN_DIR/trainer_link" cuda --nocapture || ok=1
    return $ok
}

step_cli() {
    local ds=$WORK/cli-synth ok=0
    "$GRANDIS" data synth --nodes 20000 --avg-degree 10 --features 32 --classes 8 --out "$ds" >/dev/null || return 1
    "$GRANDIS" train "$ds" --device cuda:0 --layers 3 --hidden 64 --epochs 5 || ok=1
    echo "--- a wrong ordinal must be one clear line and exit 1:"
    if "$GRANDIS" train "$ds" --device cuda:7 --epochs 1; then ok=1; fi
    return $ok
}

step_bench() {
    local args=(bench train --device cuda:0 --vertices 2400000 --edges 125000000 --features 100
        --classes 47 --homophily ${BENCH_HOMOPHILY:-0.5} --layers 3 --hidden 256
        --epochs ${BENCH_EPOCHS:-40} --target-acc ${TARGET_ACC:-0.5} --threads 16 --json)
    "$GRANDIS" "${args[@]}" --baseline pyg --pyg-adj ${BENCH_PYG_ADJ:-csr,edge_index} || return 1
    # BENCH_BASELINE names an earlier build, run right after on the same graph and GPU.
    if [ -n "${BENCH_BASELINE:-}" ]; then
        echo "--- $BENCH_BASELINE"
        "$BENCH_BASELINE" "${args[@]}" || return 1
    fi
}

step_modes() {
    local ds=$WORK/products
    # ogbn-products' split: 8% of the vertices train, 2% validate (MODES_TRAIN_FRACTION
    # shortens the epoch: its steps cost the same); 2% test, as `grandis bench steps`' graph
    # (left unset, the test split is every other vertex and the final exact evaluation of
    # 2.3M vertices outlasts a lent machine's call).
    "$GRANDIS" data synth --nodes 2400000 --avg-degree 50 --features 100 --classes 47 \
        --train-fraction ${MODES_TRAIN_FRACTION:-0.08} --val-fraction 0.02 --test-fraction 0.02 \
        --out "$ds" >/dev/null || return 1
    # Training steps only (--no-eval): evaluation in exact co-batches costs several epochs
    # (the issue "Mini-batch steps at line rate", item 6). MODES_BASELINE names a second
    # binary (an earlier build) run right after each, on the same graph and GPU.
    local bin
    for mode in mb cob; do
        local size=--batch-size
        [ "$mode" = cob ] && size=--cobatch-size
        for bin in "$GRANDIS" ${MODES_BASELINE:-}; do
            echo "--- $bin --mode $mode"
            timeout ${MODE_TIMEOUT:-200} "$bin" train "$ds" --mode $mode --device cuda --servers 1 --devices 1 $size 1024 \
                --sampling fanout --fanouts 15,10,5 --layers 3 --hidden 256 --epochs ${MODE_EPOCHS:-1} \
                --no-eval ${MODES_ARGS:-} --json || return 1
        done
    done
}

# The `losses` of two `--json` runs (last stdout line each) agree within REL relative.
same_losses() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a, b = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:3])
rel = float(sys.argv[3])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
ok = len(a["losses"]) == len(b["losses"]) and worst <= rel
print(f"  {len(a['losses'])} epochs, worst relative loss difference {worst:.2e} (limit {rel:g}), "
      f"median epoch cpu {a['median_epoch_s']:.4f}s gpu {b['median_epoch_s']:.4f}s: {'ok' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
}

step_ranks() {
    local ds=$WORK/ranks-synth ok=0
    "$GRANDIS" data synth --nodes ${RANKS_NODES:-20000} --avg-degree 12 --features 32 --classes 8 --out "$ds" >/dev/null || return 1
    local common=(--servers 2 --devices 2 --layers 3 --hidden 64 --epochs 5 --json)
    echo "--- one process on cuda:0, full batch (the single-GPU reference):"
    "$GRANDIS" train "$ds" --device cuda:0 --layers 3 --hidden 64 --epochs 5 --json 2>/dev/null | tail -1 |
        python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("  median epoch %.4fs" % d["median_epoch_s"])' || ok=1
    local runs=("fb" "flx --preload-hops 1" "flx --preload-hops 2" "flx --preload-hops 3" \
                "cob --cobatch-size 2000" "mb --batch-size 1000")
    for r in "${runs[@]}"; do
        local tag=${r// /_}
        echo "--- --mode $r"
        "$GRANDIS" train "$ds" --mode $r "${common[@]}" --device cpu >"$WORK/ranks-$tag-cpu.json" 2>"$WORK/ranks-$tag-cpu.err" || { tail -3 "$WORK/ranks-$tag-cpu.err"; ok=1; continue; }
        "$GRANDIS" train "$ds" --mode $r "${common[@]}" --device cuda:0 >"$WORK/ranks-$tag-gpu.json" 2>"$WORK/ranks-$tag-gpu.err" || { tail -3 "$WORK/ranks-$tag-gpu.err"; ok=1; continue; }
        same_losses "$WORK/ranks-$tag-cpu.json" "$WORK/ranks-$tag-gpu.json" 1e-4 || ok=1
        transport_is "$WORK/ranks-$tag-gpu.json" "device copies inside servers, quic between" || ok=1
    done
    # One GPU cannot hold two NCCL ranks of a communicator: this proves the library, the
    # communicators' set-up (ids over the fabric) and the watchdog wait on hardware, with one
    # rank per communicator.
    echo "--- --mode fb, 1 x 1, NCCL inside and between servers"
    local one=(--mode fb --servers 1 --devices 1 --layers 3 --hidden 64 --epochs 5 --json)
    "$GRANDIS" train "$ds" "${one[@]}" --device cpu >"$WORK/ranks-nccl-cpu.json" 2>"$WORK/ranks-nccl-cpu.err" || { tail -3 "$WORK/ranks-nccl-cpu.err"; ok=1; }
    "$GRANDIS" train "$ds" "${one[@]}" --device cuda:0 --inter-transport nccl >"$WORK/ranks-nccl-gpu.json" 2>"$WORK/ranks-nccl-gpu.err" || { tail -3 "$WORK/ranks-nccl-gpu.err"; ok=1; }
    same_losses "$WORK/ranks-nccl-cpu.json" "$WORK/ranks-nccl-gpu.json" 1e-4 || ok=1
    transport_is "$WORK/ranks-nccl-gpu.json" "nccl inside servers, nccl between" || ok=1
    # Two daemon processes (a coordinator and QUIC between them), each with its 2 ranks on the
    # one GPU, against the in-process CPU runs above (same flags, so the same losses).
    local m
    for m in "fb" "cob --cobatch-size 2000"; do
        local tag=${m// /_}
        echo "--- cluster up --mode $m --device cuda:0 (2 daemons x 2 ranks)"
        [ -s "$WORK/ranks-$tag-cpu.json" ] || { echo "  no CPU run to compare with"; ok=1; continue; }
        "$GRANDIS" cluster up --dataset "$ds" --mode $m "${common[@]}" --device cuda:0 \
            >"$WORK/cluster-$tag-gpu.json" 2>"$WORK/cluster-$tag-gpu.err" || { tail -5 "$WORK/cluster-$tag-gpu.err"; ok=1; continue; }
        same_losses "$WORK/ranks-$tag-cpu.json" "$WORK/cluster-$tag-gpu.json" 1e-4 || ok=1
    done
    return $ok
}

step_links() {
    local ok=0 g=$WORK/links-synth small=$WORK/links-small
    local pyg=(--baseline pyg --device cuda:0 --threads 16 --dropout 0 --json)
    echo "--- Cora, GCN 1433 -> 128 -> 64, dot decoder, 100 epochs, 3 seeds"
    "$GRANDIS" bench train --task link --data "${GRANDIS_CORA:-data/cora}" --model gcn --layers 2 \
        --hidden 128 --out-dim 64 --epochs 100 --seeds 3 "${pyg[@]}" || ok=1
    if [ -d "${GRANDIS_LASTFM:-data/lastfm}" ]; then
        echo "--- Last.fm, SAGE over 64 learnable embedding columns, 50 epochs, 3 seeds"
        "$GRANDIS" bench train --task link --data "${GRANDIS_LASTFM:-data/lastfm}" --model sage \
            --layers 2 --hidden 64 --out-dim 64 --embedding-dim 64 --epochs 50 --seeds 3 "${pyg[@]}" || ok=1
    fi
    "$GRANDIS" data synth --nodes ${LINKS_NODES:-200000} --avg-degree 20 --features 64 --classes 16 --out "$g" >/dev/null || return 1
    echo "--- synthetic ${LINKS_NODES:-200000} vertices, SAGE 64 -> 64 -> 64, 20 epochs"
    "$GRANDIS" bench train --task link --data "$g" --model sage --layers 2 --hidden 64 --out-dim 64 \
        --epochs 20 --seeds 1 "${pyg[@]}" || ok=1
    # Device ranks: a 20,000-vertex graph's link split, 2 servers x 2 ranks sharing the GPU.
    "$GRANDIS" data synth --nodes 20000 --avg-degree 12 --features 32 --classes 8 --out "$small" >/dev/null || return 1
    "$GRANDIS" data split-edges "$small" "$small-links" --seed 0 >/dev/null || return 1
    local common=(--task link --servers 2 --devices 2 --layers 2 --hidden 64 --out-dim 64 --epochs 5 --json)
    local r
    # The last two: learnable embeddings sharded across the device ranks.
    for r in "fb" "flx --preload-hops 2" "mb --batch-size 20000" "cob --cobatch-size 40000" \
        "flx --preload-hops 1 --embedding-dim 16" "mb --batch-size 20000 --embedding-dim 16"; do
        local tag=${r// /_}
        echo "--- --task link --mode $r"
        "$GRANDIS" train "$small-links" --mode $r "${common[@]}" --device cpu >"$WORK/links-$tag-cpu.json" 2>"$WORK/links-$tag-cpu.err" || { tail -3 "$WORK/links-$tag-cpu.err"; ok=1; continue; }
        "$GRANDIS" train "$small-links" --mode $r "${common[@]}" --device cuda:0 >"$WORK/links-$tag-gpu.json" 2>"$WORK/links-$tag-gpu.err" || { tail -3 "$WORK/links-$tag-gpu.err"; ok=1; continue; }
        same_losses "$WORK/links-$tag-cpu.json" "$WORK/links-$tag-gpu.json" 1e-4 || ok=1
    done
    return $ok
}

# The run summary's transport (the last line of a --json run) is the one expected.
transport_is() {
    tail -1 "$1" | python3 -c '
import json, sys
got = json.loads(sys.stdin.read()).get("transport", "")
print(f"  transport: {got}")
sys.exit(0 if got == sys.argv[1] else 1)' "$2"
}

# libnccl.so.2 from the nvidia-nccl wheel, for the NCCL transport.
NCCL_LIB=$(python3 -c '
import glob, sys
for p in sys.path:
    for d in glob.glob(p + "/nvidia/nccl/lib"):
        print(d); sys.exit(0)' 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

for s in "${STEPS[@]}"; do
    case "$s" in
        info|parity|cli|bench|modes|ranks|links) run_step "$s" "step_$s" ;;
        *) echo "unknown step '$s' (expected info, parity, cli, bench, modes, ranks or links)" >&2; exit 2 ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all steps passed: ${STEPS[*]}"
