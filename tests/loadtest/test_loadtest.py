"""`instgenie loadtest`: workload generation (distributions, Poisson arrivals, masks, traces),
the open-loop driver's accounting against a scripted HTTP server, the statistics, and the whole
command against a real `instgenie serve` (tiny model, CPU)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from instgenie.cli import main as cli_main
from instgenie.loadtest import driver, report, workload
from instgenie.loadtest.driver import OK, Outcome
from instgenie.loadtest.workload import WorkloadError
from tests.server.test_harness import ROOT, ServerProcess, shared_server

TRACES = ROOT / "traces"


# ---- workload ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, mean",
    [
        ("fixed:0.2", 0.2),
        ("uniform:0.08,0.30", 0.19),
        ("beta:0.19,5", 0.19),
        (f"hist:{TRACES / 'mask_ratios_mean019.json'}", 0.19),
        (f"hist:{TRACES / 'mask_ratios_mean011.json'}", 0.11),
    ],
)
def test_mask_ratio_distributions_have_their_mean(spec: str, mean: float) -> None:
    d = workload.parse_mask_ratios(spec)
    r = d.sample(np.random.default_rng(0), 200_000)
    assert r.min() > 0 and r.max() <= 1
    assert abs(r.mean() - mean) < 0.006, (spec, r.mean())  # 0.115 for the 0.11 histogram's bins
    assert abs(d.mean - r.mean()) < 0.002


def test_histogram_draws_follow_the_weights(tmp_path: Path) -> None:
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"bin_edges": [0.0, 0.1, 0.5, 1.0], "weights": [1, 0, 3]}))
    r = workload.parse_mask_ratios(f"hist:{f}").sample(np.random.default_rng(1), 100_000)
    assert not np.any((r >= 0.1) & (r < 0.5))  # the empty bin is never drawn
    assert abs(np.mean(r < 0.1) - 0.25) < 0.01 and abs(np.mean(r >= 0.5) - 0.75) < 0.01


@pytest.mark.parametrize(
    "spec",
    ["fixed:0", "fixed:1.5", "fixed:x", "uniform:0.3,0.1", "uniform:0.1", "beta:1,2",
     "beta:0.2,-1", "beta:0.2,nan", "gauss:0.2,0.1", "hist:/nonexistent.json"],
)  # fmt: skip
def test_bad_mask_ratio_specs_are_refused(spec: str) -> None:
    with pytest.raises(WorkloadError, match="mask ratios"):
        workload.parse_mask_ratios(spec)


@pytest.mark.parametrize(
    "doc",
    [
        {"bin_edges": [0.0, 0.5, 0.4], "weights": [1, 1]},  # not increasing
        {"bin_edges": [0.0, 0.5, 1.5], "weights": [1, 1]},  # past 1
        {"bin_edges": [0.0, 0.5, 1.0], "weights": [1]},  # a weight short
        {"bin_edges": [0.0, 0.5, 1.0], "weights": [0, 0]},  # all zero
        {"bin_edges": [0.0, 0.5, 1.0], "weights": [1, -1]},
        {"edges": [0.0, 1.0], "weights": [1]},
    ],
)
def test_bad_histograms_are_refused(tmp_path: Path, doc: dict) -> None:
    f = tmp_path / "h.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(WorkloadError, match="mask ratios"):
        workload.parse_mask_ratios(f"hist:{f}")


def test_poisson_offsets_have_exponential_gaps() -> None:
    rate = 5.0
    gaps = np.diff(workload.poisson_offsets(rate, 50_000, np.random.default_rng(2)), prepend=0)
    assert abs(gaps.mean() * rate - 1) < 0.02  # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.02  # coefficient of variation 1
    assert abs(np.mean(gaps < 1 / rate) - (1 - math.exp(-1))) < 0.01  # P(gap < mean) = 1 - 1/e
    same = workload.poisson_offsets(rate, 10, np.random.default_rng(2))
    assert np.array_equal(same, workload.poisson_offsets(rate, 10, np.random.default_rng(2)))
    assert np.allclose(workload.constant_offsets(4.0, 3), [0.25, 0.5, 0.75])


@pytest.mark.parametrize("size", [(256, 256), (320, 192), (100, 70)])
def test_rect_mask_reports_the_ratio_it_drew(size: tuple[int, int]) -> None:
    rng = np.random.default_rng(3)
    w, h = size
    g = workload.GRID_PX
    cells = (w // g) * (h // g)
    for want in (0.01, 0.05, 0.19, 0.35, 0.7, 1.0):
        png, got = workload.rect_mask(w, h, want, rng)
        m = np.asarray(Image.open(io.BytesIO(png)))
        assert m.shape == (h, w) and set(np.unique(m)) <= {0, 255}
        white = int((m == 255).sum())
        assert white == round(got * cells) * g * g  # whole cells, as many as reported
        assert white >= g * g  # at least one cell
        assert abs(got - want) * cells <= 1 + 0.25 * want * cells, (want, got)  # a rectangle
    with pytest.raises(WorkloadError):
        workload.rect_mask(16, 64, 0.2, rng)


def test_trace_replay_and_its_errors(tmp_path: Path) -> None:
    ratios = workload.parse_mask_ratios("fixed:0.3")
    rng = np.random.default_rng(0)
    f = tmp_path / "t.csv"
    f.write_text("at_s,mask_ratio,template\n0.5,0.1,0\n0.5,,5\n2.0,1,\n")
    a = workload.read_trace(f, ratios, 2, rng)
    assert [x.at_s for x in a] == [0.5, 0.5, 2.0]
    assert [x.mask_ratio for x in a] == [0.1, 0.3, 1.0]  # a missing ratio comes from --mask-ratios
    assert a[0].template == 0 and a[1].template == 1 and 0 <= a[2].template < 2  # wrapped
    bursty = workload.read_trace(TRACES / "bursty_arrivals.csv", ratios, 4, rng)
    assert len(bursty) == 143 and bursty[-1].at_s < 120
    for text, line in [
        ("at_s\n1\n0.5\n", 3),  # decreasing
        ("at_s,mask_ratio\n1,0\n", 2),
        ("at_s,mask_ratio\n1,1.2\n", 2),
        ("at_s,template\n1,-1\n", 2),
        ("at_s\nsoon\n", 2),
    ]:
        f.write_text(text)
        with pytest.raises(WorkloadError, match=f"line {line}"):
            workload.read_trace(f, ratios, 2, rng)
    f.write_text("time,mask_ratio\n1,0.2\n")
    with pytest.raises(WorkloadError, match="at_s"):
        workload.read_trace(f, ratios, 2, rng)


# ---- statistics ----------------------------------------------------------------------------------
def _ok(i: int, sent: float, latency_s: float) -> Outcome:
    o = Outcome(i, sent, 0.2, sent_s=sent, done_s=sent + latency_s, status=200, code=OK)
    timings = {"queue_ms": 10.0, "server_queue_ms": 1.0, "denoise_ms": 100.0}
    o.answer = {"mask_ratio": 0.25, "path": "masked", "cache_tier": "dram", "timings": timings}
    return o


def test_step_modes_from_two_scrapes() -> None:
    """Steps by graph mode between two /metrics reads, summed over workers."""
    from instgenie.messages import StepEntry
    from instgenie.server.metrics import Metrics

    def entry(i: int, graph: str, ms: float) -> StepEntry:
        return StepEntry(step=i, t_start=0.0, duration_ms=ms, members=[], joined=[],
                         waited_ms=[], left=[], bytes_loaded=0, compute_all_blocks=0,
                         policy="continuous", graph=graph)  # fmt: skip

    m = Metrics()
    m.observe_steps(0, [entry(0, "warmup", 60.0)])
    before = report.step_totals(m.render().decode())
    m.observe_steps(0, [entry(1, "capture", 90.0), entry(2, "replay", 20.0)])
    m.observe_steps(1, [entry(0, "replay", 30.0), entry(1, "eager", 64.0)])
    modes = report.step_modes(before, report.step_totals(m.render().decode()))
    assert list(modes) == ["capture", "eager", "replay"]  # no warm-up since `before`
    assert modes["replay"]["n"] == 2 and modes["replay"]["mean_ms"] == pytest.approx(25.0)
    assert modes["capture"]["mean_ms"] == pytest.approx(90.0)
    assert sum(v["share"] for v in modes.values()) == pytest.approx(1.0)
    assert modes["eager"]["share"] == pytest.approx(0.25)
    # a server restarted between the reads: its counters went back; nothing is made up
    assert report.step_modes(report.step_totals(m.render().decode()), before) == {}


def test_summary_counts_failures_as_slo_misses() -> None:
    outs = [_ok(i, float(i), 0.1 * (i + 1)) for i in range(8)]  # 100, 200, ..., 800 ms
    outs.append(Outcome(8, 8.0, 0.2, sent_s=8.0, done_s=8.05, status=503, code="overloaded"))
    outs.append(Outcome(9, 9.0, 0.2, done_s=9.0))  # never sent: client_overload
    s = report.summarize(outs, wall_s=10.0, slo_ms=450.0)
    assert (s["requests"], s["sent"], s["ok"]) == (10, 9, 8)
    assert s["errors"] == {"overloaded": 1, "client_overload": 1}
    assert s["error_status"] == {"503": 1}
    assert s["latency_ms"]["n"] == 8 and s["latency_ms"]["max"] == pytest.approx(800)
    assert s["latency_ms"]["p50"] == pytest.approx(450)  # numpy's linear interpolation
    assert s["slo_attainment"] == pytest.approx(4 / 10)  # 100..400 ms of 10 arrivals
    assert s["throughput_rps"] == pytest.approx(0.8) and s["goodput_rps"] == pytest.approx(0.4)
    assert s["paths"] == {"masked": 8} and s["mask_ratio_served_mean"] == 0.25
    assert s["offered_rps"] == pytest.approx(10 / 9)
    assert "SLO 450 ms met by 40.0%" in report.one_line("x", s)


def test_interior_throughput_leaves_out_the_ramp_and_the_drain() -> None:
    """A saturated phase: answers slow while the batch fills and empties, one every 0.5 s in
    between; the interior rate (quartile to quartile of answer times) reads the 2 per second,
    where answers over the whole wall time read less."""
    done = [3.0, 5.0, 6.0, 6.5] + [7.0 + 0.5 * i for i in range(8)] + [11.0, 14.0, 17.0, 21.0]
    outs = [_ok(i, 0.1 * i, 0.1) for i in range(len(done))]
    for o, t in zip(outs, done, strict=True):
        o.done_s = t
    s = report.summarize(outs, wall_s=21.0, slo_ms=None)
    assert s["interior_throughput_rps"] == pytest.approx(2.0)  # answers 4..12: 8 over 7.0..11.0 s
    assert s["throughput_rps"] == pytest.approx(16 / 21)
    assert report.interior_rate(done[:7]) is None  # too few answers to have an interior
    assert report.interior_rate([5.0] * 8) is None  # no span


# ---- the driver against a scripted server --------------------------------------------------
class _Scripted(BaseHTTPRequestHandler):
    """POST /v1/edits: sleeps body["sleep_s"], answers body["status"] (error shape if not 200)."""

    received: list[float] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append(time.monotonic())
        time.sleep(body["sleep_s"])
        status = body["status"]
        if status == 200:
            out = {"image": "aGk=", "mask_ratio": 0.1, "path": "masked", "timings": {}}
        else:
            out = {"error": {"code": "overloaded", "message": "queue full"}}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def scripted():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    srv.daemon_threads = True
    _Scripted.received = []
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_open_loop_sends_on_schedule_while_answers_are_slow(scripted: str) -> None:
    """Ten requests 50 ms apart, each answered after 400 ms: all are sent on time (a closed
    loop would have sent the last one after ~4 s); every third one is a 503."""
    bodies = [{"sleep_s": 0.4, "status": 503 if i % 3 == 2 else 200} for i in range(10)]
    offsets = [0.05 * (i + 1) for i in range(10)]
    outs, wall = driver.run_phase(scripted, bodies, offsets, [0.1] * 10, 64, 10.0)
    assert [o.sent_s is not None for o in outs] == [True] * 10
    assert max(o.sent_s - o.scheduled_s for o in outs) < 0.15
    assert outs[-1].sent_s < 0.7 and wall < 1.6
    assert [o.code for o in outs].count("overloaded") == 3
    assert {o.status for o in outs if o.code != OK} == {503}
    assert all(o.latency_ms >= 400 for o in outs)
    assert outs[0].answer["path"] == "masked" and "image" not in outs[0].answer


def test_arrivals_beyond_max_inflight_are_counted_not_sent(scripted: str) -> None:
    bodies = [{"sleep_s": 0.5, "status": 200} for _ in range(6)]
    outs, _ = driver.run_phase(scripted, bodies, [0.01 * i for i in range(6)], [0.1] * 6, 2, 10.0)
    assert [o.code for o in outs] == [OK, OK] + ["client_overload"] * 4
    assert len(_Scripted.received) == 2  # the server saw only what was sent
    s = report.summarize(outs, 1.0, 1000.0)
    assert s["sent"] == 2 and s["slo_attainment"] == pytest.approx(2 / 6)


def test_timeouts_and_refused_connections_are_counted(scripted: str) -> None:
    outs, _ = driver.run_phase(scripted, [{"sleep_s": 1.0, "status": 200}], [0.0], [0.1], 4, 0.2)
    assert (outs[0].code, outs[0].status) == ("timeout", 0)
    with ThreadingHTTPServer(("127.0.0.1", 0), _Scripted) as closed:
        port = closed.server_address[1]  # bound, then closed: nothing listens there
    outs, _ = driver.run_phase(f"http://127.0.0.1:{port}", [{}], [0.0], [0.1], 4, 5.0)
    assert outs[0].code == "connection"


# ---- the command ---------------------------------------------------------------------------------
def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_usage_errors_exit_2_before_any_request(capsys, tmp_path: Path) -> None:  # noqa: ANN001
    nowhere = "http://127.0.0.1:9"  # refused if it were contacted: that would exit 1
    for argv, why in [
        (["--mask-ratios", "normal:0.2"], "mask ratios"),
        (["--fail-under", "0.9"], "--fail-under"),
        (["--slo-ms", "100", "--fail-under", "2"], "--fail-under"),
        (["--size", "100"], "multiple of 32"),
        (["--full", "--template-id", "ab"], "--full"),
        (["--full-fraction", "1.5"], "--full-fraction"),
        (["--full", "--full-fraction", "0.5"], "--full-fraction"),
        (["--trace", str(tmp_path / "none.csv")], "trace"),
        (["--out", str(tmp_path)], "directory"),
    ]:
        assert cli_main(["loadtest", "--server", nowhere, *argv]) == 2, argv
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["loadtest", "--rate", "0"])
    assert e.value.code == 2
    assert cli_main(["loadtest", "--server", nowhere]) == 1
    assert "connection" in capsys.readouterr().err


@pytest.fixture(scope="module")
def srv(request: pytest.FixtureRequest) -> ServerProcess:
    return shared_server(request)


def test_loadtest_against_a_real_server(srv: ServerProcess, capsys, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "report.json"
    hist = f"hist:{TRACES / 'mask_ratios_mean019.json'}"
    argv = ["loadtest", "--server", srv.url, "--size", "64", "--templates", "2", "--rate", "3",
            "6", "--requests", "4", "--warmup", "1", "--slo-ms", "120000", "--seed", "5",
            "--mask-ratios", hist, "--out", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    phases = _lines(capsys.readouterr().out)
    assert [p["phase"] for p in phases] == ["rate 3/s", "rate 6/s"]
    for p in phases:
        assert (p["requests"], p["ok"], p["errors"]) == (4, 4, {}), p
        assert p["paths"] == {"masked": 4}  # edits of registered templates hit their caches
        assert sum(p["workers"].values()) == 4  # requests answered per worker index
        assert p["slo_attainment"] == 1.0 and p["latency_ms"]["n"] == 4
    full = json.loads(out.read_text())
    for p in full["phases"]:
        # the phase's own denoising steps, read from /metrics: at least the longest request's,
        # at most all of theirs (steps are shared when requests overlap); CPU: all eager
        steps = [r["num_steps"] for r in p["rows"]]
        assert list(p["steps"]) == ["eager"], p["steps"]
        eager = p["steps"]["eager"]
        assert max(steps) <= eager["n"] <= sum(steps), (steps, eager)
        assert eager["share"] == 1.0 and eager["mean_ms"] > 0
    rows = full["phases"][0]["rows"]
    assert len(rows) == 4 and all(r["cache"] == "hit" for r in rows)
    assert all(r["mask_ratio"] == pytest.approx(r["mask_ratio_requested"]) for r in rows)
    # the templates this run registered are gone again
    for i in range(2):
        tid = hashlib.sha256(workload.template_image(64, i)).hexdigest()
        assert srv.get(f"/v1/templates/{tid}").status_code == 404

    assert cli_main([*argv[:-2], "--full", "--rate", "6", "--slo-ms", "1",
                     "--fail-under", "0.5"]) == 1  # fmt: skip
    (p,) = _lines(capsys.readouterr().out)
    assert p["paths"] == {"full": 4} and p["slo_attainment"] == 0.0

    # a mixed workload: the edits drawn as full are sent as unregistered images of the same size
    mixed = tmp_path / "mixed.json"
    assert cli_main([*argv[:-1], str(mixed), "--rate", "6", "--requests", "6",
                     "--full-fraction", "0.5"]) == 0  # fmt: skip
    rows = json.loads(mixed.read_text())["phases"][0]["rows"]
    assert 0 < sum(r["full_sent"] for r in rows) < 6  # seed 5 draws both kinds
    for r in rows:
        assert (r["path"], r["cache"]) == (("full", None) if r["full_sent"] else ("masked", "hit"))


@pytest.mark.parametrize("distinct", [False, True])
def test_distinct_prompts_give_every_edit_its_own_prompt(distinct: bool) -> None:
    import argparse

    from instgenie.loadtest.command import Templates, edit_body

    args = argparse.Namespace(prompt="a red jacket", distinct_prompts=distinct,
                              output_format="png", steps=None, guidance=None, lora=[],
                              lora_fraction=1.0)  # fmt: skip
    tpl = Templates()
    tpl.ids, tpl.sizes, tpl.images = ["t0"], [(64, 64)], [None]
    prompts = {edit_body(args, tpl, 0, b"m", seed=s)["prompt"] for s in range(5)}
    assert prompts == ({f"a red jacket, variant {s}" for s in range(5)} if distinct
                       else {"a red jacket"})  # fmt: skip
    assert all("loras" not in edit_body(args, tpl, 0, b"m", seed=s) for s in range(5))


def test_edits_name_loras_in_turn() -> None:
    """--lora A --lora B:0.5: edit `seed` names the (seed mod 2)-th; --lora-fraction 0 none."""
    import argparse

    from instgenie.loadtest.command import Templates, edit_body

    a, b = "a" * 64, "b" * 64
    args = argparse.Namespace(prompt="x", distinct_prompts=False, output_format="png",
                              steps=None, guidance=None, lora=[a, f"{b}:0.5"],
                              lora_fraction=1.0)  # fmt: skip
    tpl = Templates()
    tpl.ids, tpl.sizes, tpl.images = ["t0"], [(64, 64)], [None]
    named = [edit_body(args, tpl, 0, b"m", seed=s)["loras"] for s in range(4)]
    assert named == [[{"id": a, "scale": 1.0}], [{"id": b, "scale": 0.5}]] * 2
    args.lora_fraction = 0.0
    assert all("loras" not in edit_body(args, tpl, 0, b"m", seed=s) for s in range(4))
