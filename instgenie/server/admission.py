"""Admission by cost: every edit and template capture is priced before it takes a place, and one
that would hold a worker longer than the deployment allows is refused (422 too_costly).

The price comes from a worker's CostSpec through scheduler.estimate (the router's pricing): with
a fitted profile, milliseconds of the loop's work for the request alone - its steps at its
working size and step count, plus the VAE/prompt encode and decode the loop runs for it - and
without one, the steps in nominal FLOPs (every transformer block, attention's quadratic term
included: a 4096^2 image on a model native at 512^2 costs 64x the tokens and far more than 64x
the attention). Either way it is also expressed in *native edits*: units of one edit at the
model's native area with its default steps and guidance, on the full path, priced the same way,
so one budget means the same thing for every model and device:

- `ServerConfig.max_request_cost` (native edits; 0 = DEFAULT_COST_BUDGET) always applies;
- `ServerConfig.max_request_seconds` (0 = off) applies where the worker has a fitted profile.

Pure Python (no torch): it runs in the API process.
"""

from __future__ import annotations

from dataclasses import dataclass

from instgenie.scheduler.estimate import Estimator
from instgenie.scheduler.spec import CostSpec
from instgenie.server.errors import ApiError

#: max_request_cost = 0: this many native edits. An edit at the default pixel cap (4x the native
#: area) with the default steps costs 7-13 of them on the tiny models (attention grows with the
#: square of the tokens), at twice the default steps 13-25: both fit; a 4096^2 image at one step
#: costs thousands (tests/server/test_admission.py)
DEFAULT_COST_BUDGET = 32.0


@dataclass(frozen=True)
class Price:
    units: float  # native edits (see the module docstring)
    seconds: float | None  # predicted seconds of the loop's work, with a fitted profile; else None


class CostAdmission:
    def __init__(self, native: int, max_cost: float, max_seconds: float) -> None:
        self.native = native  # the model's native side, pixels
        self.max_cost = max_cost or DEFAULT_COST_BUDGET  # native edits
        self.max_seconds = max_seconds  # 0 = off
        self._estimators: dict[int, tuple[CostSpec, Estimator, float]] = {}

    def _estimator(self, spec: CostSpec) -> tuple[Estimator, float]:
        """The estimator of `spec` and the price of one native edit under it."""
        hit = self._estimators.get(id(spec))
        if hit is None or hit[0] is not spec:
            if len(self._estimators) > 16:  # specs of restarted workers
                self._estimators.clear()
            est = Estimator(spec)
            ref = _price_ms(est, self.native * self.native, None, None, None)
            hit = self._estimators[id(spec)] = (spec, est, max(ref, 1e-9))
        return hit[1], hit[2]

    def price(
        self,
        spec: CostSpec,
        pixels: int,
        steps: int | None,
        guidance: float | None,
        strength: float | None = None,
    ) -> Price:
        """The price of one edit (or capture) of `pixels` working pixels on a worker of `spec`."""
        est, ref = self._estimator(spec)
        ms = _price_ms(est, pixels, steps, guidance, strength)
        return Price(ms / ref, ms / 1e3 if est.fitted else None)

    def check(
        self,
        specs: list[CostSpec],
        pixels: int,
        steps: int | None,
        guidance: float | None,
        strength: float | None = None,
        *,
        what: str = "this edit",
    ) -> Price | None:
        """Refuse (ApiError 422 too_costly) a request over budget on every worker of `specs`
        (its cheapest worker decides); None when no worker has reported a CostSpec yet."""
        if not specs:
            return None
        best = min(
            (self.price(s, pixels, steps, guidance, strength) for s in specs),
            key=lambda p: p.units,
        )
        side = int(pixels**0.5)
        if best.units > self.max_cost:
            raise ApiError(
                422,
                "too_costly",
                f"num_inference_steps: {what} at {pixels} working pixels (~{side}^2) and "
                f"{steps or 'the default'} steps costs {best.units:.1f} native edits (one edit "
                f"at the model's native {self.native}x{self.native} with its default steps = 1); "
                f"the limit is {self.max_cost:g} (--max-request-cost): use fewer pixels or "
                "steps, or raise the limit",
                "num_inference_steps",
            )
        if self.max_seconds and best.seconds is not None and best.seconds > self.max_seconds:
            raise ApiError(
                422,
                "too_costly",
                f"num_inference_steps: {what} at {pixels} working pixels (~{side}^2) and "
                f"{steps or 'the default'} steps is predicted to take {best.seconds:.1f} s of "
                f"a worker; the limit is {self.max_seconds:g} s (--max-request-seconds): use "
                "fewer pixels or steps, or raise the limit",
                "num_inference_steps",
            )
        return best


def _price_ms(
    est: Estimator, pixels: int, steps: int | None, guidance: float | None, strength: float | None
) -> float:
    """One request alone on the full path: its steps, encode and decode (ms, or nominal ms)."""
    work = est.work(pixels, steps, guidance, None, None, strength)
    return (
        work.steps * est.step_ms([work])
        + est.stage_ms("encode", pixels)
        + est.stage_ms("decode", pixels)
    )
