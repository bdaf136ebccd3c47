"""Fine-tuning and what leaves a run: LoRA/QLoRA, starting values from a Hugging Face directory,
peft-format adapters, Hugging Face export, and the end-of-run sample."""
