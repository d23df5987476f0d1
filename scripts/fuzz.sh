#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets) for SECONDS each, JOBS at a time, with the
# committed seeds (fuzz/seeds/TARGET) and a growing corpus (fuzz/corpus/TARGET, not committed).
# Crashes land in fuzz/artifacts/TARGET; each becomes a regression test (docs/fuzzing.md).
#   scripts/fuzz.sh [SECONDS=600] [JOBS=2] [TARGET...]
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-600}
jobs=${2:-2}
shift $(( $# > 2 ? 2 : $# ))
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build
mkdir -p logs
run() {
    local t=$1
    mkdir -p "corpus/$t"
    local seeds=()
    [ -d "seeds/$t" ] && seeds=("seeds/$t")
    # -rss_limit_mb: a parser that allocates what a header claims shows up as a crash.
    if cargo +nightly fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        > "logs/$t.log" 2>&1; then
        echo "$t: clean, $(grep -o 'stat::number_of_executed_units: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$') runs in ${seconds}s"
    else
        echo "$t: FAILED (see fuzz/logs/$t.log and fuzz/artifacts/$t)"
    fi
}
running=0
for t in "${targets[@]}"; do
    run "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n
        running=$((running - 1))
    fi
done
wait
