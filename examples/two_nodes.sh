#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, one torchrun in
# each, as two hosts on one network would run. Needs root (or CAP_NET_ADMIN) and iproute2.
# Every argument after PROCS_PER_NODE is passed to `shardtrain train`.
#
#   usage: examples/two_nodes.sh [--replicas] PROCS_PER_NODE [shardtrain train arguments...]
#   e.g.:  examples/two_nodes.sh 2 --config tiny --parallel.tp 2 --train.steps 10
#          examples/two_nodes.sh --replicas 1 --config tiny --train.steps 10
#
# Without --replicas (fault.mode = restart): one job, the two torchruns meeting by c10d
# rendezvous over the veth link (--nnodes 2). Node 0 hosts the rendezvous store (`is_host`:
# torchrun cannot tell from the container's hostname that the endpoint address is its own).
#
# With --replicas (fault.mode = replicas, parallel.replicas = 2): each node is one replica
# group, its own torchrun (--standalone: its rendezvous stays inside the node), and torchft's
# lighthouse runs on node 0 at 10.77.0.1:29510. A group's torchrun restarts it up to
# $MAX_RESTARTS times (default 0), and it rejoins from the other node's group.
#
# Node 0 is 10.77.0.1, node 1 is 10.77.0.2. Both namespaces share the machine's hostname,
# which resolves to loopback, so each node advertises its veth address instead: torchrun's
# `--local-addr`, and under --replicas `--fault.advertise` (torchft's manager, checkpoint
# transfer and store). Gloo finds its interface by GLOO_SOCKET_IFNAME. The namespaces and
# the link are removed on exit.
set -euo pipefail
replicas=0
if [[ ${1:-} == --replicas ]]; then
    replicas=1
    shift
fi
per_node=$1
shift
tag=st$$  # unique names: interface names must stay under 16 characters
ns=("${tag}n0" "${tag}n1")
dev=("${tag}v0" "${tag}v1")
addr=(10.77.0.1 10.77.0.2)
pids=()
lighthouse=""

cleanup() {  # a torchrun still running (this script was stopped): it stops its workers
    for pid in ${pids[@]+"${pids[@]}"} $lighthouse; do kill "$pid" 2>/dev/null || true; done
    for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
    ip link set "${dev[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${dev[$i]}"
    ip -n "${ns[$i]}" link set "${dev[$i]}" up
    ip -n "${ns[$i]}" link set lo up
done

if ((replicas)); then
    # The timeouts shardtrain's own launcher gives its lighthouse (launch_replicas.py): a
    # group silent for 2 s is out of the quorum; a quorum waits 1 s for a late joiner.
    RUST_LOG=${RUST_LOG:-warn} ip netns exec "${ns[0]}" torchft_lighthouse --min_replicas 1 \
        --bind "[::]:29510" --join_timeout_ms 1000 --heartbeat_timeout_ms 2000 &
    lighthouse=$!
fi

for i in 0 1; do
    if ((replicas)); then
        ip netns exec "${ns[$i]}" env GLOO_SOCKET_IFNAME="${dev[$i]}" RUST_LOG="${RUST_LOG:-warn}" \
            SHARDTRAIN_REPLICA="$i" TORCHFT_LIGHTHOUSE="http://${addr[0]}:29510" \
            torchrun --standalone --nproc-per-node "$per_node" \
            --max-restarts "${MAX_RESTARTS:-0}" \
            -m shardtrain train "$@" --fault.mode replicas --parallel.replicas 2 \
            --fault.advertise "${addr[$i]}" &
    else
        ip netns exec "${ns[$i]}" env GLOO_SOCKET_IFNAME="${dev[$i]}" \
            torchrun --nnodes 2 --nproc-per-node "$per_node" --rdzv-backend c10d \
            --rdzv-endpoint "${addr[0]}:29400" --rdzv-id "$tag" --max-restarts 0 \
            --rdzv-conf "is_host=$((1 - i))" --local-addr "${addr[$i]}" \
            -m shardtrain train "$@" &
    fi
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
pids=()  # all ended: nothing for cleanup to stop
exit "$status"
