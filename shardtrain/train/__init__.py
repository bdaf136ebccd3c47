"""The training loop and what it needs: the trainer, optimizers, pacing and guards; checkpoint/,
finetune/, observe/ and start/ hold the concerns around the loop."""
