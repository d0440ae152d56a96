"""What decoding computes with: model loading and presets, a model with its KV cache, prompts, devices."""
