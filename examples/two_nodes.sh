#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, one torchrun in
# each, meeting by c10d rendezvous over the veth link (--nnodes 2), as two hosts on one
# network would. Needs root (or CAP_NET_ADMIN) and iproute2. Every argument after the
# first is passed to `shardtrain train`.
#
#   usage: examples/two_nodes.sh PROCS_PER_NODE [shardtrain train arguments...]
#   e.g.:  examples/two_nodes.sh 2 --config tiny --parallel.tp 2 --train.steps 10
#
# Node 0 is 10.77.0.1 and hosts the rendezvous store (`is_host`: torchrun cannot tell from
# the container's hostname that the endpoint address is its own), node 1 is 10.77.0.2;
# `--local-addr` makes each node advertise its veth address, not the shared hostname. Gloo finds its
# interface by GLOO_SOCKET_IFNAME. The namespaces and the link are removed on exit.
set -euo pipefail
per_node=$1
shift
tag=st$$  # unique names: interface names must stay under 16 characters
ns=("${tag}n0" "${tag}n1")
dev=("${tag}v0" "${tag}v1")
addr=(10.77.0.1 10.77.0.2)

cleanup() {
    for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for i in 0 1; do
    ip link set "${dev[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${dev[$i]}"
    ip -n "${ns[$i]}" link set "${dev[$i]}" up
    ip -n "${ns[$i]}" link set lo up
done

pids=()
for i in 0 1; do
    ip netns exec "${ns[$i]}" env GLOO_SOCKET_IFNAME="${dev[$i]}" \
        torchrun --nnodes 2 --nproc-per-node "$per_node" --rdzv-backend c10d \
        --rdzv-endpoint "${addr[0]}:29400" --rdzv-id "$tag" --max-restarts 0 \
        --rdzv-conf "is_host=$((1 - i))" --local-addr "${addr[$i]}" \
        -m shardtrain train "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
