"""The parameter server: servers hold the parameters and the optimizer, workers compute
gradients, push them and pull the new weights (Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server"; seeds 000 and 001).

- layout.py: who holds what. The flat parameter vector (forward order) is cut into S equal
  byte ranges, one per server, and each range into partitions of `ps_partition_mb` that never
  span two parameter tensors; a partition's position in forward order is its priority.
- server.py: the server loop. `sync` applies the average of every worker's gradient once per
  step (the update of all-reduce data parallelism); `async` applies each worker's gradient as
  it arrives; `ssp` (stale synchronous parallel, Ho et al. 2013) lets no worker run more than
  `ps_staleness` steps ahead of the slowest (0: sync). Each applied update's staleness is
  recorded.
- worker.py: pushes each partition's gradient as soon as backward produced it (wait-free
  back-propagation, Zhang et al. 2017, Poseidon), in priority order with a bounded number in
  flight (ByteScheduler's credit, Peng et al. 2019), and pulls the new weights so that the
  next forward starts on the first layers while later ones still arrive.
- codec.py: compression on push (int8, top-k with error feedback).
"""
