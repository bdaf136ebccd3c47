"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards model states over the dp
group instead of replicating them: stage 1 the optimizer state and master weights, stage 2
also the gradients, stage 3 also the parameters (FSDP's flat-parameter design, Zhao et al.
2023).

- units.py:   flat units (a block's parameters as views of one padded buffer) and UnitComm
- reducer.py: gradients to fp32 shards (reduce-scatters launched as backward completes units)
- buckets.py: consecutive units reduce-scattered by one collective (comm.bucket_mb)
- gather.py:  ZeRO-3's gather-before-use, free-after-use parameter life cycle with prefetch;
              under a pipeline, gathered once per step (`StepGatherer`)
- events.py:  the forward events a model or pipeline chunk gathers its units at
- optim.py:   the shard optimizer interface and its on-device implementation
- offload.py: the optimizer state and step on the host (ZeRO-Offload) or NVMe (ZeRO-Infinity)
- zeropp.py:  ZeRO++ (Wang et al. 2023): int8 weights (qwZ), node-local secondary shards (hpZ),
              int8 gradients (qgZ)
- fp8_gather.py: the blocks' fp8 weights gathered in e4m3 with agreed scales (train.fp8)
- model.py:   `ZeroModel`, the layout's update half that ties them together
"""
