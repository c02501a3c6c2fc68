"""The mask-aware scheduler: everything that decides about cost and routing (InstGenIE §4.2-4.4).

Importable without torch, diffusers or scikit-learn (the API server and the router run it; a
test imports it with torch blocked). It imports neither instgenie.cache (storage) nor
instgenie.engine (the model); the engine calls it.

- `fits.py`: the linear latency model (`LinearFit`) and the profile schema (`Profile`, its check
  against a model's block classes); measuring a profile is engine work (engine/profiling.py).
- `spec.py`: what a worker reports so that it can be priced without its model: `BlockSpec` per
  hooked block and the worker's `CostSpec` (travels on the wire, messages.py).
- `pricing.py`: FLOPs and bytes of a block, and `step_costs`, the one function that prices a
  step's blocks; the worker's per-step planner (engine/step_pricing.py) and the router's
  estimate both call it.
- `planner.py`: the block-wise DP over those costs (paper Algorithm 1, made exact).
- `estimate.py`: the router's price of a worker's step and stages (`Estimator`), mask token
  ratios.
- `views.py`: what the router reads (`RouteRequest`, `WorkerView`).
- `routing.py`: the routing policies (round-robin, least-loaded, mask-aware = paper Algorithm 2).
- `batching.py`: the worker loop's admission policies (continuous, static, naive-continuous).
- `step.py`: one denoising step as a value (`StepPlan`: members, joined, horizon, the
  compute-all set, graph use) that the worker's batcher builds and passes down to the executor.
"""
