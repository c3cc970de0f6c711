#!/usr/bin/env bash
# The tfdist test cluster: a real Slurm 22.05 cluster of three nodes on this one machine.
#
#   tests/slurm/cluster.sh start    start it, or do nothing if it is already healthy
#   tests/slurm/cluster.sh stop     stop what the pid files name; remove our namespaces, bridge
#                                   (refused while a pytest session uses it, unless --force)
#   tests/slurm/cluster.sh status   exit 0 if running and healthy, 1 if not (prints why)
#   tests/slurm/cluster.sh env      print `export` lines for client commands and tests
#   tests/slurm/cluster.sh check    exit 0 if this machine can run it, 3 with the reason if not
#   tests/slurm/cluster.sh logs     print the daemons' logs
#   tests/slurm/cluster.sh revive N start node N's slurmd again (after a test killed it)
#
# What runs (all as root, state under $TFDIST_SLURM_DIR, default /tmp/tfdist-slurm):
# - munged as user munge with its own key and socket (slurm.conf names it: AuthInfo=socket=).
# - slurmctld in the root network namespace, at 10.77.9.1 on bridge tfdist-br0, in its own UTS
#   and mount namespace with hostname tfdist-ctl.
# - one slurmd per node n9, n10, n11, each in its own network namespace (tfdist-n9, ...) with
#   its own hostname and address (10.77.9.9, .10, .11) and a private hosts file bind-mounted
#   over /etc/hosts in its own mount namespace (the machine's /etc/hosts is never edited). The
#   names sort differently as strings ("n10" < "n9") than in Slurm's order (n9 first), which is
#   what TensorFlow's stock resolver gets wrong. Each node declares CPUs=4 and two fake GPUs
#   (gres gpu:fake:2, devices are symlinks to /dev/null); pmix is available (srun --mpi=pmix).
# - the pyxis stand-in SPANK plugin (pyxis_standin.c), compiled here and cached, loaded through
#   plugstack.conf. Jobs find the apptainer stand-in in tests/slurm/standins (put it on PATH).
# Nodes see the whole filesystem (mount propagation slave), so jobs run the checkout's .venv.
# Override the subnet with TFDIST_SLURM_SUBNET (three octets) and the controller's port with
# TFDIST_SLURM_PORT. The namespace and bridge names are fixed: one test cluster per machine.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BASE=${TFDIST_SLURM_DIR:-/tmp/tfdist-slurm}
SUBNET=${TFDIST_SLURM_SUBNET:-10.77.9}
CTLD_PORT=${TFDIST_SLURM_PORT:-16817}
SLURMD_PORT=16818
NODE_NUMBERS=(9 10 11)
NODE_LIST="n[9-11]"
PARTITION=debug
GRES_TYPE=fake
GPUS_PER_NODE=2
CPUS_PER_NODE=4
CTL_NAME=tfdist-ctl
BRIDGE=tfdist-br0
NS_PREFIX=tfdist-
START_TIMEOUT=${TFDIST_SLURM_START_TIMEOUT:-30}
CONF=$BASE/etc/slurm.conf
RECORD=$BASE/run/network.created
export SLURM_CONF=$CONF

log() { echo "cluster.sh: $*" >&2; }
die() { log "$*"; exit 1; }
nodes() { local n; for n in "${NODE_NUMBERS[@]}"; do echo "n$n"; done; }

# --- pid files: a pid counts only while it still runs the program it was written for ---------

pid_alive() {  # PIDFILE COMM; a zombie (state Z, not yet reaped) is not alive
    local pid stat
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == "$2" ]] || return 1
    stat=$(</proc/"$pid"/stat) || return 1
    [[ ${stat##*) } != Z* ]]
}

stop_pidfiles() {  # PIDFILE:COMM...: SIGTERM all, wait up to 5 s together, then SIGKILL
    local spec pids=() pid deadline
    for spec in "$@"; do
        if pid_alive "${spec%:*}" "${spec##*:}"; then
            pid=$(<"${spec%:*}")
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    deadline=$((SECONDS + 5))
    for pid in "${pids[@]}"; do
        while [[ -d /proc/$pid ]] && ((SECONDS < deadline)); do sleep 0.05; done
        if [[ -d /proc/$pid ]]; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    for spec in "$@"; do rm -f "${spec%:*}"; done  # the daemons remove theirs; stale ones too
}

# --- preflight --------------------------------------------------------------------------------

check() {
    local missing=() packages=() cmd err probe="${NS_PREFIX}probe-$$"
    local -A package_of=([slurmctld]=slurm-wlm [slurmd]=slurm-wlm [sinfo]=slurm-wlm
        [srun]=slurm-wlm [sbatch]=slurm-wlm [scontrol]=slurm-wlm [scancel]=slurm-wlm
        [munged]=munge [mungekey]=munge [ip]=iproute2 [nsenter]=util-linux
        [unshare]=util-linux [runuser]=util-linux [flock]=util-linux)
    if [[ $(id -u) -ne 0 ]]; then
        echo "the Slurm test cluster needs root (network namespaces, munged as user munge," \
             "slurmd as root); run the tests as root"
        return 3
    fi
    for cmd in slurmctld slurmd munged mungekey sinfo srun sbatch scontrol scancel ip nsenter \
               unshare runuser flock; do
        if ! command -v "$cmd" >/dev/null; then
            missing+=("$cmd")
            [[ " ${packages[*]} " == *" ${package_of[$cmd]} "* ]] || packages+=("${package_of[$cmd]}")
        fi
    done
    if ((${#missing[@]})); then
        echo "missing ${missing[*]}: install the Debian packages ${packages[*]} as root" \
             "('make system' runs tools/system-packages.sh)"
        return 3
    fi
    id munge >/dev/null 2>&1 || { echo "no user 'munge': reinstall the munge package"; return 3; }
    if ! err=$(ip netns add "$probe" 2>&1); then
        echo "network namespaces are not available here ('ip netns add' failed: $err)"
        return 3
    fi
    ip netns del "$probe"
}

# --- configuration ----------------------------------------------------------------------------

render() {  # TEMPLATE OUTPUT: fill @NAME@ placeholders
    local node_lines="" n
    for n in "${NODE_NUMBERS[@]}"; do
        node_lines+="NodeName=n$n NodeAddr=$SUBNET.$n CPUs=$CPUS_PER_NODE Boards=1"
        node_lines+=" SocketsPerBoard=1 CoresPerSocket=$CPUS_PER_NODE ThreadsPerCore=1"
        node_lines+=" Gres=gpu:$GRES_TYPE:$GPUS_PER_NODE State=UNKNOWN"$'\n'
    done
    NODE_LINES=${node_lines%$'\n'} awk -v base="$BASE" -v ctl="$CTL_NAME" \
        -v addr="$SUBNET.1" -v cport="$CTLD_PORT" -v dport="$SLURMD_PORT" \
        -v part="$PARTITION" -v list="$NODE_LIST" -v gres="$GRES_TYPE" \
        -v last=$((GPUS_PER_NODE - 1)) '
        { gsub(/@BASE@/, base); gsub(/@CTL_NAME@/, ctl); gsub(/@CTL_ADDR@/, addr)
          gsub(/@CTLD_PORT@/, cport); gsub(/@SLURMD_PORT@/, dport); gsub(/@PARTITION@/, part)
          gsub(/@NODE_LIST@/, list); gsub(/@GRES_TYPE@/, gres); gsub(/@LAST_GPU@/, last)
          if ($0 == "@NODE_LINES@") $0 = ENVIRON["NODE_LINES"]
          print }' "$1" >"$2"
}

write_config() {
    local n i
    rm -rf "$BASE/jobs"  # the last session's job directories are kept until a fresh start
    mkdir -p "$BASE"/{etc,run,log,state,spool,nodetmp,gpus,lib,jobs}
    render "$HERE/slurm.conf.in" "$CONF"
    render "$HERE/gres.conf.in" "$BASE/etc/gres.conf"
    for ((i = 0; i < GPUS_PER_NODE; i++)); do ln -sfn /dev/null "$BASE/gpus/nvidia$i"; done
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $CTL_NAME"
        for n in "${NODE_NUMBERS[@]}"; do echo "$SUBNET.$n n$n"; done
    } >"$BASE/etc/hosts"
    for n in $(nodes); do mkdir -p "$BASE/spool/$n" "$BASE/nodetmp/$n"; done
    if build_plugin; then
        echo "required $BASE/lib/pyxis_standin.so" >"$BASE/etc/plugstack.conf"
    else
        : >"$BASE/etc/plugstack.conf"
    fi
}

config_current() {  # the running cluster was started from the current templates and plugin
    local sum
    render "$HERE/slurm.conf.in" "$CONF.new"
    render "$HERE/gres.conf.in" "$BASE/etc/gres.conf.new"
    cmp -s "$CONF" "$CONF.new" && cmp -s "$BASE/etc/gres.conf" "$BASE/etc/gres.conf.new" \
        || return 1
    rm -f "$CONF.new" "$BASE/etc/gres.conf.new"
    [[ -s $BASE/etc/plugstack.conf ]] || return 0
    sum=$(sha256sum "$HERE/pyxis_standin.c" | cut -d' ' -f1)
    [[ $(cat "$BASE/lib/pyxis_standin.so.sha256" 2>/dev/null) == "$sum" ]]
}

build_plugin() {  # compiled once per source version; returns 1 if it cannot be built here
    local src=$HERE/pyxis_standin.c so=$BASE/lib/pyxis_standin.so sum
    sum=$(sha256sum "$src" | cut -d' ' -f1)
    [[ -f $so && $(cat "$so.sha256" 2>/dev/null) == "$sum" ]] && return 0
    if ! command -v cc >/dev/null || [[ ! -f /usr/include/slurm/spank.h ]]; then
        log "no C compiler or no slurm/spank.h (Debian: gcc, libslurm-dev): the pyxis" \
            "stand-in is not loaded and its tests skip"
        rm -f "$so" "$so.sha256"
        return 1
    fi
    cc -shared -fPIC -O2 -Wall -Wextra -o "$so.tmp" "$src" || die "building $src failed"
    mv "$so.tmp" "$so"
    echo "$sum" >"$so.sha256"
}

# --- network ----------------------------------------------------------------------------------

record() { echo "$*" >>"$RECORD"; }

check_free() {  # refuse to touch a bridge or namespace this cluster did not create
    local n
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        die "network device $BRIDGE exists but this cluster did not create it (or lost its" \
            "record $RECORD): remove it with 'ip link del $BRIDGE'"
    fi
    for n in $(nodes); do
        if [[ -e /run/netns/$NS_PREFIX$n ]]; then
            die "network namespace $NS_PREFIX$n exists but this cluster did not create it:" \
                "remove it with 'ip netns del $NS_PREFIX$n'"
        fi
    done
    if ip -4 route show | grep -q "^$SUBNET\.0/24 "; then
        die "the subnet $SUBNET.0/24 is already routed here: pick another with" \
            "TFDIST_SLURM_SUBNET=10.x.y"
    fi
}

setup_network() {
    local n ns
    check_free
    ip link add "$BRIDGE" type bridge && record "link $BRIDGE"
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for n in "${NODE_NUMBERS[@]}"; do
        ns=$NS_PREFIX"n$n"
        ip netns add "$ns" && record "netns $ns"
        ip link add "tfd-n$n" type veth peer name eth0 netns "$ns" && record "link tfd-n$n"
        ip link set "tfd-n$n" master "$BRIDGE" up
        ip -n "$ns" addr add "$SUBNET.$n/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
}

teardown_network() {  # kills what still runs inside our namespaces (job steps), then deletes
    local kind name pids
    [[ -f $RECORD ]] || return 0
    while read -r kind name; do
        [[ $kind == netns && -e /run/netns/$name ]] || continue
        pids=$(ip netns pids "$name" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086 # one pid per word
            kill -KILL $pids 2>/dev/null || true
        fi
    done <"$RECORD"
    tac "$RECORD" | while read -r kind name; do
        case $kind in
            netns) ip netns del "$name" 2>/dev/null || true ;;
            link) ip link del "$name" 2>/dev/null || true ;;
        esac
    done
    rm -f "$RECORD"
}

# --- daemons ----------------------------------------------------------------------------------

start_munged() {
    local dir=$BASE/munge
    mkdir -p "$dir"
    chown munge:munge "$dir"
    chmod 0755 "$dir"  # munged wants its socket directory searchable by all; the key is 0600
    touch "$BASE/log/munged.log"
    chown munge:munge "$BASE/log/munged.log"
    if [[ ! -s $dir/munge.key ]]; then
        runuser -u munge -- mungekey --create --keyfile="$dir/munge.key" --bits=1024
    fi
    runuser -u munge -- munged --socket="$dir/munged.socket" --key-file="$dir/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$BASE/log/munged.log" \
        --seed-file="$dir/munged.seed" \
        || die "munged failed to start: $(tail -n 5 "$BASE/log/munged.log" 2>/dev/null)"
}

# Each daemon gets its own UTS and mount namespace: its own hostname, and the cluster's hosts
# file over /etc/hosts. `ip netns exec` is not used: it remounts /sys and slurmd then aborts.
in_node() {  # HOSTNAME COMMAND...: run in a private UTS+mount namespace
    local name=$1
    shift
    # shellcheck disable=SC2016 # $1, $2, $@ are the inner shell's arguments
    unshare --mount --uts --propagation slave -- \
        sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
        sh "$BASE/etc/hosts" "$name" "$@"
}

start_daemons() {
    local n
    start_munged
    in_node "$CTL_NAME" slurmctld -c -i -f "$CONF" || die "slurmctld failed to start"
    for n in "${NODE_NUMBERS[@]}"; do
        # nsenter runs a program, not a function: the script runs itself as `__node NAME`.
        nsenter --net="/run/netns/${NS_PREFIX}n$n" -- "$HERE/cluster.sh" __node "n$n" \
            || die "slurmd on n$n failed to start"
    done
}

cmd_revive() {  # NODE: its slurmd started again where it is not running (a node killed wholly)
    local node=${1:?usage: $0 revive NODE}
    pid_alive "$BASE/run/slurmd-$node.pid" slurmd && return 0
    nsenter --net="/run/netns/${NS_PREFIX}$node" -- "$HERE/cluster.sh" __node "$node" 9>&- \
        || die "slurmd on $node failed to start"
    log "revived $node"
}

node_states() { sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null || true; }

healthy() {  # all daemons alive and every node usable
    local n states
    pid_alive "$BASE/munge/munged.pid" munged || { echo "munged is not running"; return 1; }
    pid_alive "$BASE/run/slurmctld.pid" slurmctld || { echo "slurmctld is not running"; return 1; }
    for n in $(nodes); do
        pid_alive "$BASE/run/slurmd-$n.pid" slurmd || { echo "slurmd on $n is not running"; return 1; }
    done
    states=$(timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %t' 2>&1) \
        || { echo "sinfo failed: $states"; return 1; }
    if grep -vqE ' (idle|alloc|mix|comp)$' <<<"$states"; then
        echo "nodes not ready: $(tr '\n' ' ' <<<"$states")"
        return 1
    fi
}

wait_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) states
    while ((SECONDS < deadline)); do
        states=$(node_states)
        if [[ $(grep -cE ' idle$' <<<"$states") -eq ${#NODE_NUMBERS[@]} ]]; then
            return 0
        fi
        sleep 0.2
    done
    log "nodes not idle after ${START_TIMEOUT}s: $(tr '\n' ' ' <<<"$states")"
    return 1
}

show_logs() {
    local f
    for f in "$BASE"/log/*.log; do
        [[ -f $f ]] || continue
        echo "==== $f (last 40 lines)"
        tail -n 40 "$f"
    done
}

# --- commands ---------------------------------------------------------------------------------

lock() {  # serialises start and stop between concurrent callers (two pytest sessions)
    mkdir -p "$BASE"
    exec 9>"$BASE/lock"
    flock -w 120 9 || die "another cluster.sh holds $BASE/lock for over 120 s"
}

start_failed() {
    local status=$?
    trap - EXIT
    show_logs >&2
    teardown
    log "start failed ($status); the logs are above and in $BASE/log"
    exit 1
}

cmd_start() {
    local started=$EPOCHREALTIME why
    check >&2 || exit 3
    lock
    if why=$(healthy); then
        if config_current; then
            log "already running ($BASE)"
            return 0
        fi
        why="tests/slurm changed since it started"
    fi
    if [[ -e $BASE/run/slurmctld.pid || -e $RECORD ]]; then log "restarting: $why"; fi
    teardown
    trap start_failed EXIT  # any failure from here on: print the logs, undo the half start
    write_config
    setup_network
    start_daemons 9>&-  # the daemons must not inherit (and so hold) the lock
    wait_idle
    trap - EXIT
    log "started ${NODE_LIST} in $(awk -v a="$started" -v b="$EPOCHREALTIME" \
        'BEGIN { printf "%.1f", b - a }') s; state in $BASE"
}

cancel_jobs() {  # ask slurmctld to end every job, then give them a moment
    local deadline=$((SECONDS + 5))
    pid_alive "$BASE/run/slurmctld.pid" slurmctld || return 0
    timeout 5 scancel --full --partition="$PARTITION" 2>/dev/null || true
    while ((SECONDS < deadline)) && [[ -n $(timeout 5 squeue -h -o %i 2>/dev/null) ]]; do
        sleep 0.2
    done
}

teardown() {
    local n daemons=("$BASE/run/slurmctld.pid:slurmctld" "$BASE/munge/munged.pid:munged")
    cancel_jobs
    for n in $(nodes); do daemons+=("$BASE/run/slurmd-$n.pid:slurmd"); done
    stop_pidfiles "${daemons[@]}"  # together: each takes 1-2 s to shut down
    teardown_network
    rm -f "$BASE/run/autostarted"
}

users() {  # pids of live pytest sessions using the cluster (tests/slurmtest.py's leases)
    local lease
    for lease in "$BASE"/leases/*; do
        [[ -f $lease && ${lease##*/} =~ ^[0-9]+$ && -d /proc/${lease##*/} ]] && echo "${lease##*/}"
    done
    return 0
}

cmd_stop() {
    local in_use
    lock
    in_use=$(users | paste -sd' ')
    if [[ -n $in_use && ${1:-} != --force ]]; then
        die "pytest sessions (pids $in_use) are using the cluster; stop them first, or" \
            "stop anyway with '$0 stop --force'"
    fi
    teardown
    log "stopped ($BASE)"
}

cmd_status() {
    local why
    if why=$(healthy); then
        echo "running ($BASE)"
    else
        echo "not running: $why"
        return 1
    fi
}

cmd_env() {
    local pyxis=0
    [[ -s $BASE/etc/plugstack.conf ]] && pyxis=1
    printf 'export %s=%q\n' \
        SLURM_CONF "$CONF" \
        TFDIST_SLURM_DIR "$BASE" \
        TFDIST_SLURM_NODES "$(nodes | paste -sd,)" \
        TFDIST_SLURM_ADDRESSES "$(for n in "${NODE_NUMBERS[@]}"; do echo "n$n=$SUBNET.$n"; done | paste -sd,)" \
        TFDIST_SLURM_PARTITION "$PARTITION" \
        TFDIST_SLURM_GRES_TYPE "$GRES_TYPE" \
        TFDIST_SLURM_GPUS_PER_NODE "$GPUS_PER_NODE" \
        TFDIST_SLURM_CPUS_PER_NODE "$CPUS_PER_NODE" \
        TFDIST_SLURM_STANDINS "$HERE/standins" \
        TFDIST_SLURM_PYXIS_STANDIN "$pyxis"
    # shellcheck disable=SC2016 # $PATH is expanded by the shell that evals this line
    printf 'export PATH=%q:"$PATH"\n' "$HERE/standins"
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status ;;
    env) cmd_env ;;
    check) check ;;
    revive) cmd_revive "${2:-}" ;;
    logs) show_logs ;;
    __node) shift; in_node "$1" slurmd -N "$1" -f "$CONF" ;;
    *) echo "usage: $0 start|stop|status|env|check|logs|revive NODE" >&2; exit 2 ;;
esac
