"""Mask-aware execution: masked-token transformer blocks that fill unmasked rows from a template's
activation cache (paper §3, Fig. 5), capture of those activations, and the per-step context."""
