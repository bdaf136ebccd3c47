"""Tensor quantization used by the optimizers and QLoRA: block-wise 8-bit with the dynamic
map (blockwise.py), 8-bit Adam moments (adam8bit.py), NF4 weights (nf4.py). Pure tensor
code: imports nothing of shardtrain."""
