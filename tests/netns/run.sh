#!/usr/bin/env bash
# Multi-host test of the grandis runtime over real network interfaces with shaped links.
#
#   tests/netns/run.sh [--bin PATH] [--servers 2|3] [--rate RATE] [--delay DELAY] [--keep]
#                      [--nodes N] [--epochs N] [--plan]
#
#   --bin PATH     grandis binary (default: $GRANDIS_BIN, else target/debug/grandis)
#   --servers N    servers (daemon namespaces), 2 or 3 (default 3)
#   --rate RATE    tc rate of every server's data-network uplink (default 20mbit)
#   --delay DELAY  netem delay added on the data network when the kernel has netem (default 1ms)
#   --nodes N      vertices of the synthetic graph (default 6000)
#   --epochs N     epochs of every job (default 4)
#   --plan         instead of the checks below: validate the planner on these links (plan the
#                  job with the rates the daemons measured, run every candidate, compare
#                  predicted with measured epochs: within 25 %, the choice within 10 % of best)
#   --keep         keep the work directory (logs, job reports, results.json); with
#                  GRANDIS_NETNS_KEEP_ON_FAILURE=1 it is kept only when the test fails
#
# Needs root (network namespaces, veth, bridge, tc). Where namespaces cannot be created (no root,
# or a sandbox that forbids them) it prints "skipped: no permission to create network
# namespaces" and exits 0; every other problem is a failure (exit 1).
#
# What it builds, all in namespaces of its own (nothing touches the host's interfaces, and only
# addresses inside 10.77.0.0/24 and 10.77.1.0/24 on these private bridges are used):
#
#   ns <p>-c   coordinator      ctl 10.77.0.1
#   ns <p>-sI  server I daemon  ctl 10.77.0.1I (heartbeats, metrics)   data 10.77.1.1I (QUIC)
#   ns <p>-sw  two bridges: bctl (control network) and bdata (data network, shaped)
#
# Every server's data interface shapes its egress with tbf at --rate (plus netem delay when the
# kernel has it), so every inter-server byte crosses exactly one shaped uplink. The control and
# data networks are separate, so the data interfaces' counters (/sys/class/net/*/statistics)
# count inter-server traffic only.
#
# Then it starts the real processes inside the namespaces (`grandis coordinator`, one `grandis
# daemon` per server), submits FB_base, FLX and FLX-EAS jobs through the REST API and checks:
#   1. per-epoch losses of each job equal the single-machine run of the same job
#      (`grandis train` with the same mode, servers, devices and seed: the loopback reference);
#   2. inter-server bytes counted on the data interfaces agree with grandis's own accounting
#      (the QUIC data-plane bytes each daemon reports) within a few percent, once the per-packet
#      headers (Ethernet, IPv4, UDP: counted from the interfaces' packet counters) are taken off;
#   3. at the low uplink rate, FLX trains faster per epoch than FB_base.
# Everything (processes, namespaces, veths, bridges) is removed on exit, also on failure.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="${GRANDIS_BIN:-$repo/target/debug/grandis}"
servers=3
rate=20mbit
delay=1ms
keep=0
nodes=6000
epochs=4
plan=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="${2:?}"; shift 2 ;;
        --servers) servers="${2:?}"; shift 2 ;;
        --rate) rate="${2:?}"; shift 2 ;;
        --delay) delay="${2:?}"; shift 2 ;;
        --keep) keep=1; shift ;;
        --nodes) nodes="${2:?}"; shift 2 ;;
        --epochs) epochs="${2:?}"; shift 2 ;;
        --plan) plan=(--plan); shift ;;
        -h|--help) sed -n '2,43p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$servers" in 2|3) ;; *) echo "run.sh: --servers must be 2 or 3" >&2; exit 2 ;; esac

say() { printf '[netns %(%T)T] %s\n' -1 "$*"; }
die() { printf '[netns] FAILED: %s\n' "$*" >&2; exit 1; }

skip_no_permission() {
    echo "skipped: no permission to create network namespaces ($1)"
    exit 0
}
[ "$(id -u)" = 0 ] || skip_no_permission "not root"
for tool in ip tc curl python3; do
    command -v "$tool" >/dev/null || die "missing tool: $tool (Debian packages iproute2, curl, python3)"
done
[ -x "$bin" ] || die "no grandis binary at $bin (cargo build --bin grandis, or --bin PATH)"

# A short, unique prefix: interface names are limited to 15 characters.
p="gn$(printf '%04x' $(( $$ % 65536 )))"
probe="$p-probe"
if ! err="$(ip netns add "$probe" 2>&1)"; then
    skip_no_permission "ip netns add: $err"
fi
ip netns del "$probe"

work="$(mktemp -d /tmp/grandis-netns.XXXXXX)"
C="$p-c"
SW="$p-sw"
S=()
for ((i = 1; i <= servers; i++)); do S+=("$p-s$i"); done
pids=()

cleanup() {
    local rc=$?
    set +e
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    # Deleting a namespace deletes the interfaces in it; a veth pair goes with either end.
    for ns in "$C" "${S[@]}" "$SW"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
        ip netns del "$ns" 2>/dev/null
    done
    if [ $rc -ne 0 ]; then
        for f in "$work"/logs/*.log; do
            [ -f "$f" ] || continue
            echo "--- last lines of $f" >&2
            tail -15 "$f" >&2
        done
    fi
    if [ "$keep" = 1 ] || { [ $rc -ne 0 ] && [ -n "${GRANDIS_NETNS_KEEP_ON_FAILURE:-}" ]; }; then
        echo "[netns] work directory kept: $work" >&2
    else
        rm -rf "$work"
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
trap 'echo "[netns] FAILED: line $LINENO: $BASH_COMMAND" >&2' ERR

# --- network ----------------------------------------------------------------------------------
say "namespaces: $C, ${S[*]}, $SW; data uplinks shaped to $rate"
for ns in "$SW" "$C" "${S[@]}"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # No IPv6 on these links: neighbour discovery and MLD would add traffic to the counters.
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
done
for br in bctl bdata; do
    ip -n "$SW" link add "$br" type bridge
    ip -n "$SW" link set "$br" up
done

# link NS IFNAME BRIDGE ADDR: a veth pair created inside the switch namespace, one end moved
# to NS (named IFNAME there), the other enslaved to BRIDGE. Nothing is created in the host's
# namespace.
link() {
    local ns="$1" ifname="$2" br="$3" addr="$4"
    local port="${ns#"$p"-}-$ifname"               # e.g. s1-data: unique inside the switch
    ip -n "$SW" link add "$port" type veth peer name "$ifname" netns "$ns"
    ip -n "$SW" link set "$port" master "$br" up
    ip -n "$ns" addr add "$addr/24" dev "$ifname"
    ip -n "$ns" link set "$ifname" up
}
link "$C" ctl bctl 10.77.0.1
for ((i = 1; i <= servers; i++)); do
    link "${S[i - 1]}" ctl bctl "10.77.0.1$i"
    link "${S[i - 1]}" data bdata "10.77.1.1$i"
done

# The token bucket's depth: small, so that a message of a few KB (an all-reduce of a small
# model's weights) is held to the rate like a large one, as on a real link of that rate; a
# 32 KB bucket let such messages through at the veth's speed, and the planner's predictions
# of plans whose epochs are mostly those messages read 1.3-1.9x their measured epochs.
burst=4kb
netem=0
if ip netns exec "${S[0]}" tc qdisc add dev data root handle 1: netem delay "$delay" 2>/dev/null; then
    ip netns exec "${S[0]}" tc qdisc del dev data root
    netem=1
else
    say "netem is not available in this kernel: no added delay, tbf rate shaping only"
fi
for ((i = 1; i <= servers; i++)); do
    ns="${S[i - 1]}"
    if [ "$netem" = 1 ]; then
        ip netns exec "$ns" tc qdisc add dev data root handle 1: netem delay "$delay"
        ip netns exec "$ns" tc qdisc add dev data parent 1:1 handle 10: tbf rate "$rate" burst "$burst" latency 400ms
    else
        ip netns exec "$ns" tc qdisc add dev data root handle 1: tbf rate "$rate" burst "$burst" latency 400ms
    fi
done
# --- processes --------------------------------------------------------------------------------
mkdir -p "$work/logs"
token="netns-$RANDOM$RANDOM"
labels="$(for ((i = 1; i <= servers; i++)); do printf 's%d,' "$i"; done)"
"$bin" certs init --out "$work/certs" --nodes "${labels%,}" >/dev/null

say "dataset: synthetic graph"
"$bin" -q data synth --nodes "$nodes" --avg-degree 10 --features 32 --classes 8 --seed 1 \
    --out "$work/data" >/dev/null

cat >"$work/coordinator.toml" <<EOF
listen = "10.77.0.1:7700"
db_path = "$work/coordinator.redb"
token = "$token"
heartbeat_interval_ms = 200
lease_ms = 2000
down_timeout_ms = 4000
EOF
ip netns exec "$C" "$bin" coordinator --config "$work/coordinator.toml" \
    >"$work/logs/coordinator.log" 2>&1 &
pids+=($!)

for ((i = 1; i <= servers; i++)); do
    cat >"$work/daemon-s$i.toml" <<EOF
coordinator = "http://10.77.0.1:7700"
token = "$token"
label = "s$i"
devices = 1
threads = 1
data_listen = "10.77.1.1$i:7701"
cert_dir = "$work/certs"
work_dir = "$work/work-s$i"
metrics_listen = "10.77.0.1$i:7702"
ready_file = "$work/ready-s$i.json"
connect_timeout_ms = 20000
peer_timeout_ms = 10000
recv_timeout_ms = 60000
EOF
    ip netns exec "${S[i - 1]}" "$bin" daemon --config "$work/daemon-s$i.toml" \
        >"$work/logs/daemon-s$i.log" 2>&1 &
    pids+=($!)
done

for ((t = 0; t < 300; t++)); do
    ready=0
    for ((i = 1; i <= servers; i++)); do [ -s "$work/ready-s$i.json" ] && ready=$((ready + 1)); done
    [ "$ready" = "$servers" ] && break
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || die "a grandis process exited during start-up"; done
    sleep 0.1
done
[ "$ready" = "$servers" ] || die "only $ready of $servers daemons registered within 30 s"
say "coordinator and $servers daemons up"

# --- jobs and checks --------------------------------------------------------------------------
python3 "$here/jobs.py" --bin "$bin" --work "$work" --dataset "$work/data" \
    --coordinator-ns "$C" --coordinator http://10.77.0.1:7700 --token "$token" \
    --servers "${S[*]}" --rate "$rate" --netem "$netem" --delay "$delay" --epochs "$epochs" \
    "${plan[@]}"
