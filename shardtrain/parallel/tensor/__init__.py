"""Tensor and sequence parallelism (Shoeybi et al. 2019, Megatron-LM; Korthikanti et al.
2022): each layer's matrices split over the tp group, attention by heads and the MLP by its
hidden units, with the f/g communication operators around each parallel region.

- layers.py:   the module table and the column/row-parallel linears, applied by swapping modules
- ops.py:      f and g (and their sequence-parallel forms) as autograd functions
- vocab.py:    vocabulary-parallel embedding and cross-entropy
- sharding.py: which slice of each full tensor a rank holds; full state dicts, grad norms
"""
