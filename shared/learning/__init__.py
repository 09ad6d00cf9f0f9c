"""Learning on the device: LoRA adapters per target on the drafter, the distillation losses, the
training signal taken from verification, and the acceptance head."""
