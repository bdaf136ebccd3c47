"""Parallel layouts, a folder per parallelism, applied to the plain model by `parallelize`
(parallelize.py, the one place that writes down their order of application):

- tensor/    Megatron-style tensor and sequence parallelism, vocab-parallel embedding and loss
- pipeline/  pipeline parallelism: partition, schedules as data, validator, executor
- data/      data parallelism: bucketed overlapped all-reduce, top-k update compression
- zero/      ZeRO-1/2/3 sharding over the dp group, CPU/NVMe offload, ZeRO++

strategy.py is the interface the trainer drives; ready.py the in-order launch of gradient
communication that data/ and zero/ share; activation.py full activation checkpointing.
"""
