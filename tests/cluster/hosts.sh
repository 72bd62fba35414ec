#!/usr/bin/env bash
# A cluster of simulated hosts on this machine for the launcher tests (tests/clusters.rs): each host a network
# namespace (node0, node1, ... at 10.214.0.{1,2,...} behind one bridge, names resolvable in every host through
# /etc/netns/<ns>/hosts), each with its own UTS namespace for its hostname, running the real daemons:
#   - OpenSSH's sshd (Debian's openssh-server, on ports 22 and 2222) with a key made here; `DIR/ssh_config` is the
#     client's config;
#   - one slurmd per host and slurmctld on node0 (Debian's slurm-wlm), authenticated by this cluster's own munged
#     (own key and socket), configured by `DIR/slurm.conf` (export SLURM_CONF to use it).
#
#   hosts.sh up NAME DIR HOSTS   make the cluster (NAME: a short unique prefix for the namespaces, DIR: its files)
#   hosts.sh on NAME HOST CMD... run CMD on a host (in its network and UTS namespaces, hostname set)
#   hosts.sh down NAME DIR       stop every daemon and process of the cluster and remove its namespaces
# Needs root (namespaces, daemons). Everything it starts is recorded in DIR and removed by `down`.
set -euo pipefail

cmd=$1
name=$2

ns() { echo "$name-$1"; }

on() {
  local host=$1; shift
  # The host's network namespace, a mount namespace of its own for its /etc/hosts (not `ip netns exec`, which
  # remounts /sys and so hides the cgroup mounts slurmd needs) and a UTS namespace for its name.
  exec nsenter --net="/run/netns/$(ns "$host")" unshare --mount --uts -- \
    sh -c 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"' "$host" "/etc/netns/$(ns "$host")/hosts" "$@"
}

up() {
  local dir=$1 hosts=$2
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  echo "$hosts" > "$dir/hosts.count"
  ip netns add "$(ns sw)"
  ip -n "$(ns sw)" link add br0 type bridge
  ip -n "$(ns sw)" link set br0 up
  local etc_hosts="127.0.0.1 localhost"
  for ((i = 0; i < hosts; i++)); do etc_hosts+=$'\n'"10.214.0.$((i + 1)) node$i"; done
  for ((i = 0; i < hosts; i++)); do
    local n; n=$(ns "node$i")
    ip netns add "$n"
    mkdir -p "/etc/netns/$n"
    echo "$etc_hosts" > "/etc/netns/$n/hosts"
    ip link add "$name-v$i" type veth peer name "$name-s$i"
    ip link set "$name-v$i" netns "$n"
    ip link set "$name-s$i" netns "$(ns sw)"
    ip -n "$n" link set "$name-v$i" name eth0
    ip -n "$n" addr add "10.214.0.$((i + 1))/24" dev eth0
    ip -n "$n" link set eth0 up
    ip -n "$n" link set lo up
    ip -n "$(ns sw)" link set "$name-s$i" master br0
    ip -n "$(ns sw)" link set "$name-s$i" up
  done

  # ssh: one key pair for the hosts, one for the user; every host trusts the user's key.
  ssh-keygen -q -t ed25519 -N '' -f "$dir/host_key"
  ssh-keygen -q -t ed25519 -N '' -f "$dir/id_ed25519"
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  mkdir -p /run/sshd
  {
    echo "Host node*"
    echo "  IdentityFile $dir/id_ed25519"
    echo "  StrictHostKeyChecking no"
    echo "  UserKnownHostsFile /dev/null"
    echo "  LogLevel ERROR"
    echo "  BatchMode yes"
  } > "$dir/ssh_config"
  for ((i = 0; i < hosts; i++)); do
    cat > "$dir/sshd_config.node$i" <<EOF
ListenAddress 10.214.0.$((i + 1))
Port 22
Port 2222
HostKey $dir/host_key
PidFile $dir/sshd.node$i.pid
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
EOF
    (on_bg "node$i" /usr/sbin/sshd -f "$dir/sshd_config.node$i" -E "$dir/sshd.node$i.log")
  done

  # munge: this cluster's own key and socket.
  dd if=/dev/urandom of="$dir/munge.key" bs=1 count=1024 status=none
  chmod 600 "$dir/munge.key"
  mkdir -p "$dir/munge" && chmod 700 "$dir/munge"
  munged --force --socket="$dir/munge/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
  chmod 755 "$dir/munge"

  # Slurm: the controller on node0, a slurmd on every host. Each host claims the machine's CPUs (config_overrides:
  # the simulated hosts share one machine's cores).
  local cpus; cpus=$(nproc)
  mkdir -p "$dir/slurm/state"
  for ((i = 0; i < hosts; i++)); do mkdir -p "$dir/slurm/spool/node$i"; done
  cat > "$dir/slurm.conf" <<EOF
ClusterName=zerorun
SlurmctldHost=node0(10.214.0.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/slurm/state
SlurmdSpoolDir=$dir/slurm/spool/%n
SlurmctldPidFile=$dir/slurm/slurmctld.pid
SlurmdPidFile=$dir/slurm/slurmd.%n.pid
SlurmctldLogFile=$dir/slurm/slurmctld.log
SlurmdLogFile=$dir/slurm/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=DEFAULT CPUs=$cpus RealMemory=1000 State=UNKNOWN
EOF
  for ((i = 0; i < hosts; i++)); do
    echo "NodeName=node$i NodeAddr=10.214.0.$((i + 1))" >> "$dir/slurm.conf"
  done
  echo "PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >> "$dir/slurm.conf"
  export SLURM_CONF="$dir/slurm.conf"
  (on_bg node0 slurmctld -f "$dir/slurm.conf")
  for ((i = 0; i < hosts; i++)); do
    (on_bg "node$i" slurmd -f "$dir/slurm.conf")
  done
  # Ready when every node is idle and every sshd answers.
  local deadline=$((SECONDS + 60))
  until [ "$( (on_fg node0 sinfo -h -N -t idle -o %N 2>/dev/null || true) | sort -u | wc -l)" = "$hosts" ]; do
    if ((SECONDS > deadline)); then
      echo "hosts.sh: Slurm's nodes did not come up in 60 s:" >&2
      on_fg node0 sinfo -N -l >&2 || true
      tail -n 20 "$dir"/slurm/*.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  for ((i = 0; i < hosts; i++)); do
    until ip netns exec "$(ns node0)" ssh -F "$dir/ssh_config" "node$i" true 2>/dev/null; do
      if ((SECONDS > deadline)); then echo "hosts.sh: sshd on node$i does not answer" >&2; exit 1; fi
      sleep 0.2
    done
  done
}

on_bg() { (on "$@"); }
on_fg() { (on "$@"); }

down() {
  local dir=$1
  local hosts; hosts=$(cat "$dir/hosts.count" 2>/dev/null || echo 0)
  # Every process in the cluster's namespaces (daemons, jobs, stray ranks), then munged.
  for ((i = 0; i < hosts; i++)); do
    local pids; pids=$(ip netns pids "$(ns "node$i")" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  done
  [ -f "$dir/munged.pid" ] && kill "$(cat "$dir/munged.pid")" 2>/dev/null || true
  for ((i = 0; i < hosts; i++)); do
    ip netns del "$(ns "node$i")" 2>/dev/null || true
    rm -rf "/etc/netns/$(ns "node$i")"
  done
  ip netns del "$(ns sw)" 2>/dev/null || true
}

case "$cmd" in
  up) up "$3" "$4" ;;
  on) shift 2; on "$@" ;;
  down) down "$3" ;;
  *) echo "usage: hosts.sh up NAME DIR HOSTS | on NAME HOST CMD... | down NAME DIR" >&2; exit 2 ;;
esac
