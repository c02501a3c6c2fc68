"""One worker = one GPU: a supervisor process, a denoise-loop process with step-level continuous
batching, and pre/post-processing processes (paper §4.3, Fig. 10)."""
