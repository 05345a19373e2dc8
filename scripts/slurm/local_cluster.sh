#!/usr/bin/env bash
# A real Slurm cluster on this machine, for the tests (docs/cluster.md, "A Slurm cluster on one machine"):
# one slurmctld and NODES slurmd, each slurmd in a network namespace of its own (a veth pair into a Linux bridge,
# its own 10.x address) and a UTS namespace of its own (its own hostname), plus a munged of its own.
#
#   scripts/slurm/local_cluster.sh up DIR [NODES]   start it (3 nodes by default); prints the SLURM_CONF to export
#   scripts/slurm/local_cluster.sh down DIR         stop and remove everything that `up DIR` made (idempotent)
#   scripts/slurm/local_cluster.sh kill-node DIR N  a node failure: SIGKILL node N's slurmd and every process on it
#   scripts/slurm/local_cluster.sh revive-node DIR N  node N back after kill-node: its slurmd again, until idle
#   scripts/slurm/local_cluster.sh check            exit 0 if `up` can run here, else print why not and exit 1
#
# Everything lives under DIR (config, state, spools, logs, munge key and socket). Outside DIR, `up` adds only
# what it records in DIR/made: the bridge, the veth pairs, the network namespaces and /etc/hosts lines marked
# with DIR; `down` removes exactly those and stops the daemons whose pids it recorded. The system's own munged
# and Slurm, if any, are not used or touched. Needs root, slurm-wlm and munge (scripts/test.sh installs them).
# Settings: LOCAL_CLUSTER_NET (the /24 prefix, 10.77.0), LOCAL_CLUSTER_PORT (slurmctld's port, 16817),
# LOCAL_CLUSTER_TAG (up to 3 letters or digits, none by default: in the names of the nodes, anchor<TAG>-nN, and of
# the links). Clusters with different tags, prefixes and ports run side by side.
set -euo pipefail

NET=${LOCAL_CLUSTER_NET:-10.77.0}
PORT=${LOCAL_CLUSTER_PORT:-16817}
TAG=${LOCAL_CLUSTER_TAG:-}
BRIDGE=na-slurm$TAG-br
WAIT_S=60  # every wait below gives up after this long

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

node_name() { echo "anchor$TAG-n$1"; }  # node N's hostname, namespace and Slurm NodeName

# Why `up` cannot run here (nothing), on stdout
unavailable() {
  [ "$(id -u)" = 0 ] || { echo "not root (network namespaces, a bridge and /etc/hosts need root)"; return; }
  local tool
  for tool in slurmctld slurmd sbatch scontrol munged ip nsenter unshare; do
    command -v "$tool" > /dev/null || { echo "$tool is not installed (apt-get install slurm-wlm munge iproute2)"; return; }
  done
  unshare -u true 2> /dev/null || { echo "unshare -u (a UTS namespace) is refused here"; return; }
  [[ $NET =~ ^10\.[0-9]+\.[0-9]+$ ]] || { echo "LOCAL_CLUSTER_NET=$NET is not a 10.x.y prefix"; return; }
  [[ $TAG =~ ^[a-z0-9]{0,3}$ ]] || { echo "LOCAL_CLUSTER_TAG=$TAG is not 0 to 3 lowercase letters or digits"; return; }
  [[ $PORT =~ ^[0-9]+$ ]] || { echo "LOCAL_CLUSTER_PORT=$PORT is not a port number"; return; }
}

up() {
  local dir=$1 nodes=${2:-3}
  local why
  why=$(unavailable)
  [ -z "$why" ] || die "cannot start a cluster here: $why"
  [[ $nodes =~ ^[1-9]$ ]] || die "NODES must be 1 to 9, not '$nodes'"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -e "$dir/made" ] || die "$dir already holds a cluster (run: $0 down $dir)"
  if ip -4 -o addr show | grep -q " inet $NET\." || ip -4 route show | grep -q "^$NET\."; then
    die "the addresses $NET.0/24 are in use on this machine: set LOCAL_CLUSTER_NET to another 10.x.y prefix"
  fi
  ! ip link show "$BRIDGE" > /dev/null 2>&1 || die "a bridge $BRIDGE exists already (another cluster is up?)"
  mkdir -p "$dir"/{state,log,run,munge}
  : > "$dir/made"
  trap 'echo "local_cluster.sh: up failed; see $dir/log; undoing" >&2; down "$dir"' ERR

  # munge: a key and a daemon of our own (munged wants its key and socket directory private)
  chmod 700 "$dir/munge"
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" --log-file="$dir/log/munged.log"
  echo "pidfile $dir/munge/munged.pid" >> "$dir/made"

  # the network: a bridge with the controller's address, one namespace + veth pair per node
  ip link add "$BRIDGE" type bridge
  echo "link $BRIDGE" >> "$dir/made"
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local controller n name
  controller=$(hostname)
  local hosts_marker="# nemo-anchor local cluster $dir"
  for n in $(seq 1 "$nodes"); do
    name=$(node_name "$n")
    ip netns add "$name"
    echo "netns $name" >> "$dir/made"
    ip link add "nas$TAG-$n" type veth peer name "nas$TAG-$n-in"  # link names: 15 characters at most
    echo "link nas$TAG-$n" >> "$dir/made"
    ip link set "nas$TAG-$n-in" netns "$name"
    ip -n "$name" link set "nas$TAG-$n-in" name eth0
    ip -n "$name" addr add "$NET.$((10 + n))/24" dev eth0
    ip -n "$name" link set lo up
    ip -n "$name" link set eth0 up
    ip link set "nas$TAG-$n" master "$BRIDGE" up
    echo "$NET.$((10 + n)) $name $hosts_marker" >> /etc/hosts
  done
  echo "hosts $hosts_marker" >> "$dir/made"

  cat > "$dir/slurm.conf" <<EOF
# written by scripts/slurm/local_cluster.sh up $dir
ClusterName=nemo-anchor-local$TAG
SlurmctldHost=$controller($NET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# no cgroups here: processes are tracked through /proc
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
# a killed node is marked down within seconds, not minutes
SlurmdTimeout=10
KillWait=30
MinJobAge=600
NodeName=DEFAULT CPUs=2 RealMemory=1000 State=UNKNOWN
EOF
  for n in $(seq 1 "$nodes"); do
    echo "NodeName=$(node_name "$n") NodeAddr=$NET.$((10 + n))" >> "$dir/slurm.conf"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"

  # the daemons, in the foreground of sessions of their own; slurmd enters its node's namespaces
  # (nsenter, not `ip netns exec`: that remounts /sys without the cgroup mounts, and slurmd then refuses to start)
  setsid slurmctld -D -c -f "$dir/slurm.conf" > "$dir/log/slurmctld.out" 2>&1 < /dev/null &
  echo "pid $! slurmctld" >> "$dir/made"
  for n in $(seq 1 "$nodes"); do
    start_slurmd "$dir" "$(node_name "$n")"
  done
  export SLURM_CONF=$dir/slurm.conf
  local deadline=$((SECONDS + WAIT_S))
  until [ "$(sinfo -h -t idle -o '%D' 2> /dev/null)" = "$nodes" ]; do
    [ $SECONDS -lt $deadline ] || { sinfo >&2 || true; false; }
    sleep 0.5
  done
  trap - ERR
  echo "export SLURM_CONF=$dir/slurm.conf"
}

# every process in node NAME's network namespace (its slurmd, slurmstepd and job processes)
node_pids() { ip netns pids "$1" 2> /dev/null || true; }

# slurmd of node NAME, in its network namespace and a UTS namespace of its own, in the foreground of a session
start_slurmd() {
  local dir=$1 name=$2
  setsid nsenter --net="/var/run/netns/$name" unshare -u \
    sh -c 'hostname "$1"; exec slurmd -D -N "$1" -f "$2"' sh "$name" "$dir/slurm.conf" \
    >> "$dir/log/slurmd-$name.out" 2>&1 < /dev/null &
  echo "pid $! slurmd $name" >> "$dir/made"
}

kill_node() {
  local dir=$1 name
  name=$(node_name "$2")
  grep -qx "netns $name" "$dir/made" || die "$dir has no node $2"
  node_pids "$name" | xargs -r kill -KILL
}

# A failed node back in service: its slurmd started again (ReturnToService=2 makes a node that registers idle)
revive_node() {
  local dir=$1 name
  name=$(node_name "$2")
  grep -qx "netns $name" "$dir/made" || die "$dir has no node $2"
  [ -z "$(node_pids "$name")" ] || die "node $2 ($name) is not down: processes run in it"
  start_slurmd "$dir" "$name"
  local deadline=$((SECONDS + WAIT_S))
  until [ "$(SLURM_CONF=$dir/slurm.conf sinfo -h -n "$name" -t idle -o '%D' 2> /dev/null)" = 1 ]; do
    [ $SECONDS -lt $deadline ] || die "node $2 ($name) did not come back within $WAIT_S s; see $dir/log"
    sleep 0.5
  done
}

down() {
  local dir=$1
  [ -f "$dir/made" ] || return 0
  local kind what rest pid
  # daemons first (with the processes of every node), then the network, then /etc/hosts
  while read -r kind what rest; do
    case $kind in
      pid) kill -TERM "$what" 2> /dev/null || true ;;
      pidfile) [ ! -f "$what" ] || kill -TERM "$(cat "$what")" 2> /dev/null || true ;;
      netns) node_pids "$what" | xargs -r kill -KILL ;;
    esac
  done < "$dir/made"
  local deadline=$((SECONDS + 10))
  while read -r kind what rest; do
    [ "$kind" = pid ] || continue
    while kill -0 "$what" 2> /dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -KILL "$what" 2> /dev/null || true
  done < "$dir/made"
  while read -r kind what rest; do
    case $kind in
      netns) ip netns del "$what" 2> /dev/null || true ;;
      link) ip link del "$what" 2> /dev/null || true ;;
      hosts)
        local marker="$what${rest:+ $rest}"
        awk -v m=" $marker" 'substr($0, length($0) - length(m) + 1) != m' /etc/hosts > "$dir/hosts.new"
        cat "$dir/hosts.new" > /etc/hosts  # in place: /etc/hosts may be a bind mount
        rm -f "$dir/hosts.new" ;;
    esac
  done < "$dir/made"
  rm -f "$dir/made"
}

case ${1:-} in
  up) [ $# -ge 2 ] || die "usage: $0 up DIR [NODES]"; up "$2" "${3:-3}" ;;
  down) [ $# -eq 2 ] || die "usage: $0 down DIR"; down "$(cd "$2" 2> /dev/null && pwd || echo "$2")" ;;
  kill-node) [ $# -eq 3 ] || die "usage: $0 kill-node DIR N"; kill_node "$(cd "$2" && pwd)" "$3" ;;
  revive-node) [ $# -eq 3 ] || die "usage: $0 revive-node DIR N"; revive_node "$(cd "$2" && pwd)" "$3" ;;
  check) why=$(unavailable); [ -z "$why" ] || { echo "$why"; exit 1; } ;;
  *) die "usage: $0 up DIR [NODES] | down DIR | kill-node DIR N | revive-node DIR N | check" ;;
esac
