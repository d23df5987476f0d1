#!/usr/bin/env bash
# Runs deploy/slurm/grandis.sbatch under a real Slurm: slurmctld and slurmd from the
# distribution's packages (installed with apt-get when missing and running as root), configured
# for this one machine in a scratch directory, with munge for authentication.
#   1. `sbatch --wait --ntasks-per-node=2 grandis.sbatch job.toml` (two daemons, two servers) runs
#      a small flx job to success, and no grandis process outlives the allocation;
#   2. a long job is cancelled with `scancel` while it trains: the allocation ends within Slurm's
#      KillWait, no grandis process is left, and the coordinator's database opens again in a
#      fresh coordinator and still holds the job;
#   3. the same with `scancel --batch --signal=TERM` (the graceful stop, as before a time
#      limit): the database holds the job cancelled.
#
#   deploy/slurm/check.sh [--bin PATH]     (default: $GRANDIS_BIN, else target/debug/grandis)
#
# Everything started is stopped on exit (munged only if this script started it).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="${GRANDIS_BIN:-$repo/target/debug/grandis}"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="${2:?--bin needs a path}"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$bin" ] || { echo "check.sh: no grandis binary at $bin (cargo build --bin grandis, or --bin PATH)" >&2; exit 1; }
bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"

say() { printf '[slurm/check] %s\n' "$*"; }
fail() { printf '[slurm/check] FAILED: %s\n' "$*" >&2; exit 1; }

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v curl >/dev/null || need+=(curl)
# shellcheck source=deploy/lib.sh
. "$here/../lib.sh"
install_missing slurm/check "${need[@]}"

tmp="$(mktemp -d /tmp/grandis-slurm-check.XXXXXX)"
started_munge=0
pids=()
cleanup() {
    local rc=$?
    set +e
    [ -n "${SLURM_CONF:-}" ] && scancel --user "$(id -un)" >/dev/null 2>&1
    for f in "$tmp/slurmd.pid" "$tmp/slurmctld.pid"; do
        [ -s "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
    done
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    [ "$started_munge" = 1 ] && [ -s "$tmp/munged.pid" ] && kill -TERM "$(cat "$tmp/munged.pid")" 2>/dev/null
    sleep 1
    if [ "$rc" != 0 ]; then
        for f in "$tmp"/log/*.log "$tmp"/*.out; do
            [ -f "$f" ] && { echo "--- $f"; tail -n 40 "$f"; }
        done
    fi
    rm -rf "$tmp"
    exit "$rc"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# munge: Slurm's authentication. Reuse a running munged, else start one (as the munge user,
# which owns the key the package made).
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge
    chown munge:munge /run/munge 2>/dev/null || true
    [ -s /etc/munge/munge.key ] || fail "no /etc/munge/munge.key (the munge package makes it)"
    if [ "$(id -u)" = 0 ]; then
        runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/grandis-check.pid
        cp /run/munge/grandis-check.pid "$tmp/munged.pid" 2>/dev/null || true
    else
        /usr/sbin/munged
    fi
    started_munge=1
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || fail "munged does not answer"
fi

host="$(hostname)"
cpus="$(nproc)"
mkdir -p "$tmp/state" "$tmp/spool" "$tmp/log" "$tmp/runs"
export SLURM_CONF="$tmp/slurm.conf"
# One node, this machine; nothing that needs cgroups or accounting (containers have neither).
cat >"$SLURM_CONF" <<EOF
ClusterName=grandis-check
SlurmctldHost=$host
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName=$host CPUs=$cpus RealMemory=2000 State=UNKNOWN
PartitionName=check Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = idle ] && break
    sleep 0.2
done
[ "$(sinfo -h -o %T)" = idle ] || fail "the Slurm node did not come up idle: $(sinfo 2>&1)"
say "Slurm $(sinfo -V | awk '{print $2}') up: node $host, $cpus CPUs"

# No grandis process of this binary may outlive an allocation.
leftovers() { pgrep -f -- "^$bin (coordinator|daemon|submit)" || true; }
[ -z "$(leftovers)" ] || fail "grandis processes of $bin already running: $(leftovers)"

"$bin" -q data synth --nodes 2000 --avg-degree 8 --features 16 --classes 4 --seed 3 --out "$tmp/data"
job_file() { # NAME EPOCHS
    cat <<EOF
name = "$1"
dataset = "$tmp/data"
mode = "flx"
servers = 2
devices = 1
layers = 2
hidden = 16
epochs = $2
EOF
}
job_file slurm-check 3 >"$tmp/ok.toml"

export GRANDIS_BIN="$bin"
# Run directories land in the submit directory (grandis.sbatch's default).
cd "$tmp/runs"
sbatch_job() { sbatch --parsable --ntasks-per-node=2 "$@"; }

say "1. a job to success (two daemons)"
id="$(sbatch_job --wait --output="$tmp/ok.out" "$here/grandis.sbatch" "$tmp/ok.toml")" ||
    fail "sbatch --wait exited non-zero for a job that should succeed (see $tmp/ok.out above)"
grep -q "job succeeded" "$tmp/ok.out" || fail "the output does not say the job succeeded"
grep -q "^epoch *3 " "$tmp/ok.out" || fail "the output has no epoch 3 line"
! grep -q "Killed" "$tmp/ok.out" || fail "the daemons were killed instead of stopped with SIGTERM"
sleep 1
[ -z "$(leftovers)" ] || fail "grandis processes left after the allocation: $(leftovers)"
say "   allocation $id: job succeeded, no process left"

# Submits the long job, cancels it with `scancel ARGS` once it trains, and checks that the
# allocation ends, no process is left, and the database opens in a fresh coordinator and holds
# the job in one of STATES (a regex).
cancel_case() { # NAME STATES SCANCEL-ARGS...
    local name="$1" states="$2" id run jobs state
    shift 2
    job_file "$name" 1000000 >"$tmp/$name.toml"
    id="$(sbatch_job --output="$tmp/$name.out" "$here/grandis.sbatch" "$tmp/$name.toml")"
    for _ in $(seq 600); do
        grep -q "^epoch *2 " "$tmp/$name.out" 2>/dev/null && break
        [ -n "$(squeue -h -j "$id" 2>/dev/null)" ] || fail "allocation $id ended before training"
        sleep 0.2
    done
    grep -q "^epoch *2 " "$tmp/$name.out" || fail "the long job did not reach epoch 2 within 120 s"
    scancel "$@" "$id"
    for _ in $(seq 450); do
        [ -z "$(squeue -h -j "$id" 2>/dev/null)" ] && break
        sleep 0.2
    done
    [ -z "$(squeue -h -j "$id" 2>/dev/null)" ] || fail "allocation $id still exists 90 s after scancel"
    sleep 1
    [ -z "$(leftovers)" ] || fail "grandis processes left after scancel: $(leftovers)"
    run="$tmp/runs/grandis-slurm-$id"
    [ -s "$run/coordinator.redb" ] || fail "no coordinator database in $run"
    # The saved config (the node's address, port 0) and database, with a token of our own.
    rm -f "$tmp/reopen.addr"
    GRANDIS_COORDINATOR_TOKEN=check "$bin" coordinator --config "$run/coordinator.toml" \
        --addr-file "$tmp/reopen.addr" >"$tmp/log/reopen-$name.log" 2>&1 &
    local pid=$!
    pids+=("$pid")
    for _ in $(seq 100); do [ -s "$tmp/reopen.addr" ] && break; sleep 0.1; done
    [ -s "$tmp/reopen.addr" ] ||
        fail "a coordinator cannot open the database after scancel: $(tail -n 20 "$tmp/log/reopen-$name.log")"
    jobs="$(curl -sf -H "Authorization: Bearer check" "http://$(cat "$tmp/reopen.addr")/v1/jobs/1")" ||
        fail "the reopened database has no job 1"
    kill -TERM "$pid"
    wait "$pid" || fail "the reopened coordinator did not stop cleanly"
    echo "$jobs" | grep -q "\"name\":\"$name\"" || fail "the reopened database lost the job: $jobs"
    state="$(echo "$jobs" | grep -o '"state":"[a-z]*"' | head -n 1 | cut -d'"' -f4)"
    [[ "$state" =~ ^($states)$ ]] || fail "job state after scancel $*: $state, expected $states"
    say "   allocation $id: no process left, database intact, job $state"
}

# A plain scancel signals every process of the allocation at once: the coordinator may stop
# before the script's cancel reaches it, and then holds the job as a coordinator restart
# leaves it (queued again) or, if the cancel came first, cancelled.
say "2. scancel while training"
cancel_case slurm-scancel "queued|cancelled"
# SIGTERM to the batch script alone (as before the time limit): the job is cancelled first.
say "3. scancel --batch --signal=TERM while training"
cancel_case slurm-term cancelled --batch --signal=TERM
say "all Slurm checks passed"
