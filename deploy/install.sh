#!/usr/bin/env bash
# Installs grandis as systemd services on this machine (or into a staging root with --root).
#
#   deploy/install.sh [--bin PATH] [--root DIR] [--no-user]
#
#   --bin PATH   the grandis binary to install (default: target/release/grandis)
#   --root DIR   install below DIR instead of / (packaging, tests); systemctl is not called
#   --no-user    do not create the grandis system user
#
# What it writes (existing configuration files are never overwritten):
#   /usr/local/bin/grandis
#   /etc/systemd/system/grandis-coordinator.service, grandis-daemon.service
#   /etc/sysusers.d/grandis.conf                   (the `grandis` system user)
#   /etc/grandis/coordinator.toml, daemon.toml     (examples to edit; root:grandis 0640)
#   /usr/local/share/doc/grandis/                  (guide, Prometheus and Grafana files)
# It enables nothing: edit the configuration, then `systemctl enable --now grandis-daemon`
# (every server) and `systemctl enable --now grandis-coordinator` (one machine).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
bin="$repo/target/release/grandis"
root=""
make_user=1

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="${2:?--bin needs a path}"; shift 2 ;;
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        --no-user) make_user=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done

[ -x "$bin" ] || {
    echo "install.sh: $bin is not an executable grandis binary (build it with" \
        "'cargo build --release --bin grandis', or pass --bin PATH)" >&2
    exit 1
}
if [ -n "$root" ]; then
    mkdir -p "$root"
    root="$(cd "$root" && pwd)"
elif [ "$(id -u)" != 0 ]; then
    echo "install.sh: installing into / needs root (or use --root DIR)" >&2
    exit 1
fi

# install(1) writes through a temporary file and renames, so a running service never sees a
# half-written binary or unit.
install -D -m 0755 "$bin" "$root/usr/local/bin/grandis"
for unit in grandis-coordinator.service grandis-daemon.service; do
    install -D -m 0644 "$here/systemd/$unit" "$root/etc/systemd/system/$unit"
done
install -D -m 0644 "$here/systemd/grandis.sysusers" "$root/etc/sysusers.d/grandis.conf"
doc="$root/usr/local/share/doc/grandis"
install -D -m 0644 "$repo/docs/guide.md" "$doc/guide.md"
install -D -m 0644 "$here/prometheus/prometheus.yml" "$doc/prometheus/prometheus.yml"
install -D -m 0644 "$here/prometheus/alerts.yml" "$doc/prometheus/alerts.yml"
install -D -m 0644 "$here/grafana/grandis.json" "$doc/grafana/grandis.json"

if [ "$make_user" = 1 ]; then
    if command -v systemd-sysusers >/dev/null; then
        if [ -n "$root" ]; then
            systemd-sysusers --root="$root" "$root/etc/sysusers.d/grandis.conf"
        else
            systemd-sysusers /etc/sysusers.d/grandis.conf
        fi
    elif [ -z "$root" ] && ! id grandis >/dev/null 2>&1; then
        useradd --system --user-group --home-dir /var/lib/grandis --no-create-home \
            --shell /usr/sbin/nologin --comment "grandis distributed GNN training" grandis
    fi
fi

# Configuration: only when absent, so re-running the script after an upgrade keeps the
# operator's edits. The files hold tokens: readable by root and the grandis group only.
group=root
if [ "$make_user" = 1 ] && { [ -n "$root" ] && grep -q '^grandis:' "$root/etc/group" 2>/dev/null \
    || { [ -z "$root" ] && getent group grandis >/dev/null; }; }; then
    group=grandis
fi
install -d -m 0750 "$root/etc/grandis"
for conf in coordinator.toml daemon.toml; do
    if [ -e "$root/etc/grandis/$conf" ]; then
        echo "kept existing $root/etc/grandis/$conf"
    else
        install -m 0640 "$here/config/$conf" "$root/etc/grandis/$conf"
    fi
done
if [ "$(id -u)" = 0 ] && [ "$group" = grandis ] && [ -z "$root" ]; then
    chgrp grandis /etc/grandis /etc/grandis/coordinator.toml /etc/grandis/daemon.toml
fi

if [ -z "$root" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi

cat <<EOF
installed grandis into ${root:-/}
next:
  1. edit /etc/grandis/coordinator.toml (one machine) and /etc/grandis/daemon.toml (every server):
     tokens, addresses, label
  2. certificates: grandis certs init --out certs --nodes node-a,node-b,...; copy ca.pem,
     <label>.pem and <label>.key to /etc/grandis/certs/ on each server
     (chgrp grandis /etc/grandis/certs/*.key; chmod 0640 /etc/grandis/certs/*.key)
  3. systemctl enable --now grandis-coordinator   # coordinator machine
     systemctl enable --now grandis-daemon        # every server
EOF
