"""Tensor quantization used by the optimizers, QLoRA and fp8 training: block-wise 8-bit with
the dynamic map (blockwise.py), 8-bit Adam moments (adam8bit.py), NF4 weights (nf4.py),
float8 linears through torchao (float8.py, train.fp8). Pure tensor code: imports nothing of
shardtrain."""
