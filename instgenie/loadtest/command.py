"""`instgenie loadtest`: open-loop edit traffic against a running `instgenie serve`.

    instgenie loadtest --server http://127.0.0.1:8000 --rate 0.5 1 2 --requests 40 --slo-ms 8000
    instgenie loadtest --trace traces/bursty_arrivals.csv --slo-ms 8000   # replay a trace
    instgenie loadtest --mask-ratios hist:traces/mask_ratios_mean019.json --rate 2
    instgenie loadtest --full --rate 1 --requests 20          # unregistered images: the full path

Registers --templates synthetic templates (or uses --template-id ones) and waits for their
caches, sends --warmup edits one at a time (not counted), then one phase per --rate (or one
replaying --trace): edits of the templates under rectangle masks whose ratios follow
--mask-ratios, at Poisson (or evenly spaced) arrival times. One JSON line per phase goes to
stdout, a human line to stderr; --out FILE gets the whole report, one row per request (written
once at the end, whole or not at all). Each phase also counts the server's denoising steps by how
they ran (`steps`: CUDA-graph replay, capture, warm-up or eager; count, mean ms, share), from its
/metrics read before and after the phase.
Templates this run created are deleted at the end unless --keep-templates.

Exit status: 0 the phases ran (failed requests are results, counted by error code);
1 the server could not be reached or failed outside the measured traffic (readiness, a template
build, a warm-up edit), or --fail-under was not met; 2 bad arguments or an unreadable trace or
histogram; 130 interrupted.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from instgenie.errors import ValidationError
from instgenie.loadtest import driver, report, workload
from instgenie.loadtest.driver import ServerError, request_json
from instgenie.loadtest.workload import WorkloadError
from instgenie.outputs import PendingOutput

DEFAULT_SERVER = "http://127.0.0.1:8000"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: added to template seeds in --full mode: images no run registers, so no cache can serve them
FULL_SEED_OFFSET = 1_000_000


def _number(kind: type, low: float, strict: bool):
    """argparse type: a finite `kind` > low (strict) or >= low."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_loadtest_parser(sub) -> None:
    p = sub.add_parser(
        "loadtest",
        help="open-loop edit traffic against a running server: latency, throughput, SLO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pos, pos_int = _number(float, 0.0, strict=True), _number(int, 0, strict=True)
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"default {DEFAULT_SERVER}")
    p.add_argument(
        "--wait-ready-s",
        type=_number(float, 0, False),
        default=0.0,
        help="first wait up to this long, s, for GET /ready to answer 200",
    )
    p.add_argument(
        "--rate",
        type=pos,
        nargs="+",
        default=[1.0],
        help="offered requests per second; one phase per rate (default 1)",
    )
    p.add_argument("--requests", type=pos_int, default=20, help="requests per phase")
    p.add_argument("--arrivals", choices=["poisson", "constant"], default="poisson")
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="CSV arrival trace (at_s[,mask_ratio][,template]): one phase replaying "
        "it instead of --rate/--requests/--arrivals",
    )
    p.add_argument(
        "--mask-ratios",
        default="uniform:0.08,0.30",
        help="fixed:R | uniform:A,B | beta:MEAN,K | hist:FILE.json "
        "(default uniform:0.08,0.30, mean 0.19 as the paper's public trace)",
    )
    p.add_argument("--templates", type=pos_int, default=2, help="synthetic templates to register")
    p.add_argument(
        "--template-id",
        action="append",
        default=[],
        help="edit this registered template instead (repeatable)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="ID[:SCALE]",
        help="a registered LoRA (POST /v1/loras) the edits name (repeatable): edit i names the "
        "(i mod count)-th, so a batch mixes them",
    )
    p.add_argument(
        "--lora-fraction",
        type=float,
        default=1.0,
        help="with --lora: the fraction of edits (drawn per edit) that name a LoRA",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="send unregistered images instead of template ids (the full path)",
    )
    p.add_argument(
        "--full-fraction",
        type=float,
        default=0.0,
        help="send this fraction of the edits (drawn per edit) as unregistered images of the "
        "templates' size (the full path), the rest as template edits: a mixed workload",
    )
    p.add_argument(
        "--size",
        type=pos_int,
        default=512,
        help=f"synthetic template side, px (a multiple of {workload.GRID_PX})",
    )
    p.add_argument("--steps", type=pos_int, default=None, help="default: the server's")
    p.add_argument("--guidance", type=_number(float, 0, False), default=None)
    p.add_argument("--prompt", default="a red jacket")
    p.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="give every edit its own prompt (PROMPT plus its seed): no prompt-cache hits",
    )
    p.add_argument("--output-format", choices=["png", "jpeg", "webp"], default="png")
    p.add_argument(
        "--warmup",
        type=_number(int, 0, False),
        default=2,
        help="edits sent one at a time before the phases, not counted",
    )
    p.add_argument("--slo-ms", type=pos, default=None, help="latency objective per request, ms")
    p.add_argument(
        "--fail-under",
        type=_number(float, 0, False),
        default=None,
        help="exit 1 when a phase's SLO attainment (0-1) is below this (needs --slo-ms)",
    )
    p.add_argument(
        "--max-inflight",
        type=pos_int,
        default=256,
        help="requests open at once at most; an arrival beyond is client_overload",
    )
    p.add_argument("--timeout-s", type=pos, default=600.0, help="per request, s")
    p.add_argument(
        "--template-timeout-s", type=pos, default=1800.0, help="waiting for template caches, s"
    )
    p.add_argument("--seed", type=int, default=0, help="of the whole workload")
    p.add_argument("--keep-templates", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="write the full JSON report here")
    p.set_defaults(func=cmd_loadtest)  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    if args.fail_under is not None and (args.slo_ms is None or args.fail_under > 1):
        raise WorkloadError("--fail-under needs --slo-ms and a fraction in [0, 1]")
    if args.full and args.template_id:
        raise WorkloadError("--full sends unregistered images; it takes no --template-id")
    if not 0.0 <= args.full_fraction <= 1.0 or (args.full and args.full_fraction):
        raise WorkloadError("--full-fraction must be in [0, 1] and is not used with --full")
    if not 0.0 <= args.lora_fraction <= 1.0:
        raise WorkloadError("--lora-fraction must be in [0, 1]")
    workload.check_size(args.size)


def wait_ready(base: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            request_json(base, "GET", "/ready", timeout_s=5)
            return
        except ServerError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


#: the server reads its workers' step logs every health poll (0.5 s by default): after a phase,
#: /metrics is read until two reads this far apart agree, at most STEPS_SETTLE_TRIES times (a
#: server polling less often than every STEPS_SETTLE_S / 2 can be read too early)
STEPS_SETTLE_S = 1.0
STEPS_SETTLE_TRIES = 10


def scrape_steps(base: str) -> dict[str, tuple[float, float]] | None:
    """The server's step totals by graph mode (report.step_totals) once the last steps' log has
    reached it; None when /metrics cannot be read."""
    last = None
    for _ in range(STEPS_SETTLE_TRIES):
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
                now = report.step_totals(resp.read().decode())
        except (OSError, ValueError):
            return None
        if now == last:
            return now
        last = now
        time.sleep(STEPS_SETTLE_S)
    return last


class Templates:
    """The run's templates: ids, sizes, images (--full) and the ids this run created."""

    def __init__(self) -> None:
        self.ids: list[str | None] = []  # None: --full (no id; the image is sent)
        self.sizes: list[tuple[int, int]] = []  # (width, height), px
        self.images: list[bytes | None] = []
        self.created: list[str] = []

    def register(self, base: str, args: argparse.Namespace) -> None:
        if args.full:
            for i in range(args.templates):
                self.ids.append(None)
                self.sizes.append((args.size, args.size))
                self.images.append(workload.template_image(args.size, FULL_SEED_OFFSET + i))
            return
        pending = list(args.template_id)
        for i in range(0 if args.template_id else args.templates):
            body = {"image": base64.b64encode(workload.template_image(args.size, i)).decode(),
                    "prompt": "", "seed": i}  # fmt: skip
            if args.steps is not None:
                body["num_inference_steps"] = args.steps
            status, answer = request_json(base, "POST", "/v1/templates", body, 120)
            if status == 202:  # 200: already registered (same image); never deleted by us
                self.created.append(answer["id"])
            pending.append(answer["id"])
        deadline = time.monotonic() + args.template_timeout_s
        for tid in pending:
            while True:
                _, t = request_json(base, "GET", f"/v1/templates/{tid}", timeout_s=60)
                if t["status"] == "ready":
                    break
                if t["status"] == "failed":
                    raise ServerError(0, "template_failed", f"template {tid}: {t.get('error')}")
                if time.monotonic() > deadline:
                    raise ServerError(0, driver.TIMEOUT, f"template {tid} still {t['status']}")
                time.sleep(0.2)
            self.ids.append(tid)
            self.sizes.append((int(t["width"]), int(t["height"])))
            self.images.append(None)

    def delete_created(self, base: str) -> None:
        for tid in self.created:
            try:
                request_json(base, "DELETE", f"/v1/templates/{tid}", timeout_s=30)
            except ServerError as exc:
                print(f"warning: template {tid} not deleted: {exc}", file=sys.stderr)


def edit_body(
    args: argparse.Namespace, tpl: Templates, idx: int, mask: bytes, seed: int, full: bool = False
) -> dict:
    """The edit of template `idx`; `full`: of an unregistered image of its size instead."""
    prompt = f"{args.prompt}, variant {seed}" if args.distinct_prompts else args.prompt
    body: dict = {"mask": base64.b64encode(mask).decode(), "prompt": prompt, "seed": seed,
                  "output_format": args.output_format}  # fmt: skip
    if full and tpl.ids[idx] is not None:
        w, h = tpl.sizes[idx]
        image = workload.template_image(w, FULL_SEED_OFFSET + idx, height=h)
        body["image"] = base64.b64encode(image).decode()
    elif tpl.ids[idx] is None:
        body["image"] = base64.b64encode(tpl.images[idx]).decode()
    else:
        body["template_id"] = tpl.ids[idx]
    if args.steps is not None:
        body["num_inference_steps"] = args.steps
    if args.guidance is not None:
        body["guidance_scale"] = args.guidance
    if args.lora and np.random.default_rng([seed, 7]).random() < args.lora_fraction:
        lora_id, _, scale = args.lora[seed % len(args.lora)].partition(":")
        body["loras"] = [{"id": lora_id, "scale": float(scale or 1.0)}]
    return body


def plan_phases(args: argparse.Namespace, ratios: workload.MaskRatios, n_tpl: int) -> list:
    """[(label, rate or None, arrivals)] — drawn before anything is sent."""
    if args.trace is not None:
        rng = np.random.default_rng([args.seed, 0])
        return [(f"trace {args.trace}", None, workload.read_trace(args.trace, ratios, n_tpl, rng))]
    phases = []
    for k, rate in enumerate(args.rate):
        rng = np.random.default_rng([args.seed, k])
        if args.arrivals == "poisson":
            offsets = workload.poisson_offsets(rate, args.requests, rng)
        else:
            offsets = workload.constant_offsets(rate, args.requests)
        arrivals = workload.make_arrivals(offsets, ratios, n_tpl, rng, first_seed=k * 1_000_000)
        phases.append((f"rate {rate:g}/s", rate, arrivals))
    return phases


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    with PendingOutput(args.out) if args.out is not None else contextlib.nullcontext() as out:
        return _run(args, out)


def _run(args: argparse.Namespace, out: PendingOutput | None) -> int:
    ratios = workload.parse_mask_ratios(args.mask_ratios)
    if args.trace is not None:  # read (and reject) the trace before touching the server
        workload.read_trace(args.trace, ratios, 1, np.random.default_rng(0))
    base = args.server.rstrip("/")
    if args.wait_ready_s > 0:
        wait_ready(base, args.wait_ready_s)
    tpl = Templates()
    try:
        tpl.register(base, args)
        phases = plan_phases(args, ratios, len(tpl.ids))
        rng = np.random.default_rng([args.seed, 1 << 20])
        for i in range(args.warmup):  # one at a time: compiles and warms shapes
            w, h = tpl.sizes[i % len(tpl.ids)]
            mask, _ = workload.rect_mask(w, h, 0.2, rng)
            request_json(
                base,
                "POST",
                "/v1/edits",
                edit_body(args, tpl, i % len(tpl.ids), mask, seed=i),
                args.timeout_s,
            )
        full_report: dict = {"args": {k: str(v) if isinstance(v, Path) else v
                                      for k, v in vars(args).items() if k != "func"},
                             "mask_ratio_mean": ratios.mean, "phases": []}  # fmt: skip
        failed_slo = False
        for k, (label, rate, arrivals) in enumerate(phases):
            bodies, achieved = [], []
            # its own stream: the same seed gives the same arrivals and masks at any fraction
            full = np.random.default_rng([args.seed, 2 << 20, k]).random(len(arrivals))
            full = full < args.full_fraction
            for a, f in zip(arrivals, full, strict=True):  # drawn and encoded before the phase
                w, h = tpl.sizes[a.template]
                mask, got = workload.rect_mask(w, h, a.mask_ratio, rng)
                bodies.append(edit_body(args, tpl, a.template, mask, a.seed, bool(f)))
                achieved.append(got)
            steps_before = scrape_steps(base)  # the warm-ups' steps counted
            outcomes, wall = driver.run_phase(
                base, bodies, [a.at_s for a in arrivals], achieved,
                args.max_inflight, args.timeout_s,
            )  # fmt: skip
            stats = report.summarize(outcomes, wall, args.slo_ms)
            summary = {"phase": label, "rate": rate, **stats}
            steps_after = scrape_steps(base)
            if steps_before is not None and steps_after is not None:
                summary["steps"] = report.step_modes(steps_before, steps_after)
            print(json.dumps(summary), flush=True)
            print(report.one_line(label, summary), file=sys.stderr, flush=True)
            rows = [
                {"index": o.index, "scheduled_s": o.scheduled_s, "sent_s": o.sent_s,
                 "done_s": o.done_s, "latency_ms": o.latency_ms, "status": o.status,
                 "code": o.code, "message": o.message,
                 "mask_ratio_requested": o.mask_ratio_requested,
                 "template": arrivals[o.index].template, "full_sent": bool(full[o.index]),
                 **o.answer}
                for o in outcomes
            ]  # fmt: skip
            full_report["phases"].append({**summary, "rows": rows})
            if args.fail_under is not None and (summary["slo_attainment"] or 0) < args.fail_under:
                failed_slo = True
        if out is not None:
            out.commit(json.dumps(full_report, indent=1).encode())
        if failed_slo:
            print(f"SLO attainment below {args.fail_under:g} in some phase", file=sys.stderr)
        return EXIT_FAILED if failed_slo else EXIT_OK
    finally:
        if not args.keep_templates:
            tpl.delete_created(base)


def cmd_loadtest(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except (WorkloadError, ValidationError) as exc:
        print(f"invalid input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
