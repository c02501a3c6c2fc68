"""The cluster simulator (`instgenie simulate`, issue 26): hosts x GPUs serving edits of a template
catalogue, discrete-event, priced and routed by the scheduler package's own code.

- `models.py` — a worker's CostSpec without torch: committed block lists (`models.json`) plus a
  profile's fits;
- `tiers.py` — one host's DRAM and disk tiers (LRU by bytes);
- `catalogue.py` — templates, their Zipf popularity and cache bytes, initial placement;
- `workload.py` — arrivals (Poisson, a trace, a burst) and their masks' token ratios;
- `worker.py` — one GPU worker's loop, step-level continuous batching, priced by Estimator;
- `engine.py` — the event queue, the dispatcher (slots, FIFO queue, routing policy) and the
  cluster; `scenario.py` — what one run is (`Scenario`) and `simulate`;
- `report.py` — percentiles, throughput, SLO attainment; `plot.py`; `command.py` — the CLI.

Pure Python and numpy (matplotlib only for the plot): no torch.
"""
