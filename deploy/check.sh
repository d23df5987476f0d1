#!/usr/bin/env bash
# Checks the deployment assets against the real system tools and the real binary:
#   1. the systemd units, installed by deploy/install.sh into a staging root, pass
#      `systemd-analyze verify` without a single warning;
#   2. prometheus.yml and alerts.yml pass `promtool check`, and the alert unit tests
#      (alerts_test.yml) pass `promtool test rules`;
#   3. every grandis_* metric that alerts.yml and the Grafana dashboard use is exported by a real
#      coordinator and a real daemon started here on 127.0.0.1 (scraped from /metrics), every
#      label they select on exists, and the dashboard is structurally sound (metric_names.py).
#
#   deploy/check.sh [--bin PATH]     (default: $GRANDIS_BIN, else target/debug/grandis)
#
# Missing tools (systemd-analyze, promtool, curl) are installed with apt-get when running as root;
# otherwise the script stops and names them. Only 127.0.0.1 is used; everything started is stopped
# on exit.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
bin="${GRANDIS_BIN:-$repo/target/debug/grandis}"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="${2:?--bin needs a path}"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$bin" ] || { echo "check.sh: no grandis binary at $bin (cargo build --bin grandis, or --bin PATH)" >&2; exit 1; }

say() { printf '[deploy/check] %s\n' "$*"; }
fail() { printf '[deploy/check] FAILED: %s\n' "$*" >&2; exit 1; }

need=()
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v promtool >/dev/null || need+=(prometheus)
command -v curl >/dev/null || need+=(curl)
command -v python3 >/dev/null || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        fail "missing tools: ${need[*]} (install these Debian packages)"
    fi
fi

tmp="$(mktemp -d /tmp/grandis-deploy-check.XXXXXX)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT

# --- 1. systemd units ------------------------------------------------------------------------
root="$tmp/root"
"$here/install.sh" --root "$root" --bin "$bin" >"$tmp/install.log" 2>&1 \
    || fail "install.sh --root: $(cat "$tmp/install.log")"
# verify resolves dependencies (multi-user.target, network-online.target, ...) inside the root,
# so the system's own unit files go there too.
mkdir -p "$root/usr/lib/systemd"
cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
for unit in grandis-coordinator.service grandis-daemon.service; do
    out="$(systemd-analyze verify --root="$root" "$unit" 2>&1)" || fail "systemd-analyze verify $unit: $out"
    # verify exits 0 on unknown keys and bad values (it only warns): any output is a failure.
    [ -z "$out" ] || fail "systemd-analyze verify $unit printed:
$out"
    say "systemd-analyze verify $unit: clean"
done
grep -q '^grandis:' "$root/etc/passwd" || fail "install.sh created no grandis user in the staging root"

# --- 2. Prometheus configuration and alert rules ----------------------------------------------
promtool check config "$here/prometheus/prometheus.yml" >/dev/null \
    || fail "promtool check config: $(promtool check config "$here/prometheus/prometheus.yml" 2>&1)"
promtool check rules "$here/prometheus/alerts.yml" >/dev/null \
    || fail "promtool check rules: $(promtool check rules "$here/prometheus/alerts.yml" 2>&1)"
(cd "$here/prometheus" && promtool test rules alerts_test.yml >"$tmp/promtool-test.txt" 2>&1) \
    || fail "promtool test rules:
$(cat "$tmp/promtool-test.txt")"
say "promtool: prometheus.yml, alerts.yml valid; alert unit tests pass"

# --- 3. Metric names against a live coordinator and daemon ------------------------------------
python3 "$here/metric_names.py" --self-test >/dev/null || fail "metric_names.py self-test"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_http() { # url seconds pid: until the URL answers, the time is up or the process exits
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        curl -fsS -o /dev/null --max-time 1 "$1" 2>/dev/null && return 0
        kill -0 "$3" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
cport="$(free_port)"
mport="$(free_port)"
token="check-$RANDOM$RANDOM"
cat >"$tmp/coordinator.toml" <<EOF
listen = "127.0.0.1:$cport"
db_path = "$tmp/coordinator.redb"
token = "$token"
EOF
"$bin" coordinator --config "$tmp/coordinator.toml" >"$tmp/coordinator.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$cport/healthz" 30 "${pids[-1]}" || fail "coordinator did not answer within 30 s (or exited):
$(tail -20 "$tmp/coordinator.log")"

"$bin" certs init --out "$tmp/certs" --nodes check-a --localhost >/dev/null
cat >"$tmp/daemon.toml" <<EOF
coordinator = "http://127.0.0.1:$cport"
token = "$token"
label = "check-a"
data_listen = "127.0.0.1:0"
cert_dir = "$tmp/certs"
work_dir = "$tmp/work"
metrics_listen = "127.0.0.1:$mport"
EOF
"$bin" daemon --config "$tmp/daemon.toml" >"$tmp/daemon.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$mport/metrics" 30 "${pids[-1]}" || fail "daemon metrics did not answer within 30 s (or it exited):
$(tail -20 "$tmp/daemon.log")"
# Wait until the coordinator lists the daemon, so the per-daemon series have samples.
for ((i = 0; i < 100; i++)); do
    curl -fsS --max-time 1 "http://127.0.0.1:$cport/metrics" >"$tmp/coordinator.metrics"
    grep -q '^grandis_daemon_up{' "$tmp/coordinator.metrics" && break
    sleep 0.1
done
grep -q '^grandis_daemon_up{' "$tmp/coordinator.metrics" || fail "the daemon never registered:
$(tail -20 "$tmp/daemon.log")"
curl -fsS --max-time 2 "http://127.0.0.1:$mport/metrics" >"$tmp/daemon.metrics"
python3 "$here/metric_names.py" --exported "$tmp/coordinator.metrics" "$tmp/daemon.metrics" \
    --rules "$here/prometheus/alerts.yml" --dashboard "$here/grafana/grandis.json" \
    | sed 's/^/[deploy\/check] /' || fail "metric names (see above)"
say "all deployment checks passed"
