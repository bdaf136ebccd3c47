"""The training loop and what it needs: optimizers, checkpoints, metrics."""
