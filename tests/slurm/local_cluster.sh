#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for the tests that submit slurm/*.sbatch:
# Debian's slurm-wlm (slurmctld + two slurmd, node1 and node2) with munge, run as root.
# Adapted from the tried recipe in ../shared/recipes/local-slurm-cluster.sh.
#
#   usage: local_cluster.sh install          # the Debian packages, when missing (needs root + apt)
#          local_cluster.sh start DIR [PORT] # prints `export SLURM_CONF=DIR/slurm.conf`
#          local_cluster.sh stop DIR
#
# PORT (default 16817) and the next three ports: slurmctld, slurmd's default, node1, node2.
# Facts that matter here: each slurmd needs its own Port (else the second node's launch fails
# with "Job credential replayed"); node names must resolve (node1/node2 -> 127.0.0.1 in
# /etc/hosts, so MASTER_ADDR=node1 works); each node has 1 CPU (2 cores in all) and the
# partition oversubscribes, so a node can run two tasks.
set -euo pipefail
cmd=${1:?install|start|stop}

if [ "$cmd" = install ]; then
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    exit 0
  fi
  [ "$(id -u)" = 0 ] || { echo "error: installing slurm-wlm needs root" >&2; exit 2; }
  command -v apt-get >/dev/null || { echo "error: no apt-get to install slurm-wlm with" >&2; exit 2; }
  echo "installing slurmctld slurmd slurm-client munge (Debian packages)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  exit 0
fi

dir=$(realpath -m "${2:?state dir}")
if [ "$cmd" = stop ]; then
  for p in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
    [ -f "$p" ] && kill "$(cat "$p")" 2>/dev/null || true
  done
  exit 0
fi
[ "$cmd" = start ] || { echo "error: unknown command $cmd" >&2; exit 2; }
port=${3:-16817}
mkdir -p /run/munge "$dir/state" "$dir/spool"
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
fi
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged
grep -q ' node1$' /etc/hosts || printf '127.0.0.1 node1\n127.0.0.1 node2\n' >> /etc/hosts
host=$(hostname -s)
cat > "$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MinJobAge=600
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 3)) CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
for _ in $(seq 20); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
slurmd -f "$SLURM_CONF" -N node1
slurmd -f "$SLURM_CONF" -N node2
for _ in $(seq 60); do
  [ "$(sinfo -h -o '%t %D' 2>/dev/null | awk '$1 == "idle" {n += $2} END {print n + 0}')" = 2 ] && break
  sleep 0.5
done
sinfo >&2
echo "export SLURM_CONF=$SLURM_CONF"
