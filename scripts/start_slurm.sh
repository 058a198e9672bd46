#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine (Debian slurm-wlm + munge), for CI and local tests.
#   sudo bash scripts/start_slurm.sh        # idempotent; returns once `sinfo` shows the node idle
# Installs slurm-wlm and munge with apt-get only if missing; writes a munge key, starts munged as the
# munge user, writes /etc/slurm/slurm.conf (this host's CPUs and memory, one default partition "cpu"),
# and starts slurmctld and slurmd (no systemd needed). ATOMMEM_SLURM_CONF=path writes the config there
# instead (for a test); logs go to /var/log/slurm.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "start_slurm.sh: run as root (needs apt-get, /etc/slurm, daemons)" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
CONF=${ATOMMEM_SLURM_CONF:-/etc/slurm/slurm.conf}

# munge: one key, daemon as the munge user
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged --force
  for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
fi
munge -n | unmunge >/dev/null || { echo "start_slurm.sh: munged is not answering" >&2; exit 1; }

# slurm.conf for this one node
mkdir -p "$(dirname "$CONF")" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
want=$(cat <<CONFEOF
# written by scripts/start_slurm.sh: a single-node cluster on $HOST
ClusterName=atommem
SlurmctldHost=$HOST
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=cpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONFEOF
)
changed=0
if [ "$(cat "$CONF" 2>/dev/null)" != "$want" ]; then
  printf '%s\n' "$want" > "$CONF"
  changed=1
fi

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$changed" = 1 ]; then  # a new configuration: restart what runs
  for pid in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
    if running "$pid"; then kill "$(cat "$pid")"; sleep 1; fi
  done
fi
running /run/slurm/slurmctld.pid || slurmctld -f "$CONF" || { echo "start_slurm.sh: slurmctld failed; see /var/log/slurm/slurmctld.log" >&2; exit 1; }
running /run/slurm/slurmd.pid || slurmd -f "$CONF" || { echo "start_slurm.sh: slurmd failed; see /var/log/slurm/slurmd.log" >&2; exit 1; }

export SLURM_CONF=$CONF
for _ in $(seq 1 120); do
  state=$(sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -1 || true)
  case $state in
    idle|mixed|allocated) echo "slurm: node $HOST $state ($CPUS CPUs, ${MEM_MB} MB), partition cpu"; exit 0 ;;
    down*|drain*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "start_slurm.sh: node $HOST did not become idle (state: ${state:-none}); see /var/log/slurm" >&2
exit 1
