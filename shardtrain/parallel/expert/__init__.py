"""Expert parallelism (GShard, Lepikhin et al. 2020): each rank of the `ep` group holds
n_experts / ep experts; token-slots travel to their expert's rank by an all-to-all and
back by its inverse.

- layers.py: the all-to-all exchange (an autograd Function: backward is the swapped
  all-to-all) and `ExpertSlice`, the local experts in place of the MoE block's `Experts`,
  under the full model's parameter names (placements over ep, tensor/sharding.py).
- reduce.py: the gradient reducers: expert parameters over `edp`, the rest over dp.
"""
