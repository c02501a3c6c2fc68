"""Inference engine: family adapters, the step-split editing pipeline, batched scheduler math."""
