"""Per-request LoRA adapters: reading files, the layers they may adapt, row-segmented application
in mixed batches, and the worker's adapter store (host/GPU LRU, bounded asynchronous loading)."""
