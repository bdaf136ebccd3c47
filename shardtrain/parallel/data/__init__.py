"""Data parallelism (seed 000 "Data Parallelism"; Li et al. 2020, "PyTorch Distributed"):
every dp rank holds the whole model, computes gradients on its share of the batch, and the
gradients are averaged before the step.

- ddp.py:  `DataParallel`, our DDP: gradients in flat buckets, each all-reduced as soon as
           it is complete, overlapping backward; `ReplicatedUpdate`, the layout's update half.
- topk.py: `SparseUpdates`, top-k sparsification of each rank's optimizer update (Lin et al.
           2018, "Deep Gradient Compression", generalised), comm.compress=topk.
"""
