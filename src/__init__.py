"""QLoRA stability sweeps: measure which fine-tuning settings are stable on a given card."""
