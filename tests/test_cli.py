"""The `instgenie edit` command, in-process and through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from instgenie.cli import EXIT_INVALID_INPUT, EXIT_MODEL_LOAD, main
from instgenie.config import ExecConfig, to_dict
from tests.conftest import make_image, make_mask


@pytest.mark.parametrize("family", ["sd2-inpaint", "flux-fill"])
def test_edit_writes_image(family: str, tmp_path, capsys) -> None:
    img, mask = tmp_path / "in.jpg", tmp_path / "mask.png"
    make_image(160, 128).save(img)
    make_mask(160, 128).save(mask)
    out = tmp_path / "out.webp"
    code = main([
        "edit", "--model", f"{family}:tiny", "--image", str(img), "--mask", str(mask),
        "--prompt", "a green hat", "--seed", "4", "--steps", "3", "-o", str(out),
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_steps"] == 3 and summary["size"] == [160, 128]
    with Image.open(out) as result:
        assert result.format == "WEBP" and result.size == (160, 128)
    # unmasked pixels are pasted back from the input (lossy codecs: compare loosely)
    src, res = Image.open(img).convert("RGB"), Image.open(out).convert("RGB")
    assert (
        max(abs(a - b) for a, b in zip(src.getpixel((2, 2)), res.getpixel((2, 2)), strict=True))
        < 24
    )


def test_edit_invalid_input_exit_code(tmp_path, capsys) -> None:
    img, mask = tmp_path / "in.png", tmp_path / "mask.png"
    make_image(128, 128).save(img)
    make_mask(64, 64).save(mask)
    code = main([
        "edit", "--model", "sdxl-inpaint:tiny", "--image", str(img), "--mask", str(mask),
        "--prompt", "x", "--steps", "2", "-o", str(tmp_path / "o.png"),
    ])  # fmt: skip
    assert code == EXIT_INVALID_INPUT
    assert "mask: is 64x64 but the image is 128x128" in capsys.readouterr().err


def test_edit_bad_model_exit_code(tmp_path, capsys) -> None:
    code = main(["edit", "--model", "nope:tiny", "--prompt", "x", "-o", str(tmp_path / "o.png")])
    assert code == EXIT_INVALID_INPUT  # a typo: a usage error, before anything is loaded
    assert "invalid input: model: unknown model family 'nope'" in capsys.readouterr().err
    # a directory that exists but holds no diffusers model: the load itself fails
    (tmp_path / "empty").mkdir()
    code = main(["edit", "--model", f"sd2-inpaint:{tmp_path / 'empty'}", "--prompt", "x",
                 "-o", str(tmp_path / "o.png")])  # fmt: skip
    assert code == EXIT_MODEL_LOAD
    assert "model load failed" in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("command", ["edit", "bench-step", "profile"])
@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "cuda:99"],
         "device: 'cuda"),
        (["--device", "bogus"], "device: Expected one of cpu, cuda"),
        (["--dtype", "bogus"], "dtype: unknown dtype 'bogus'"),
    ],
    ids=["absent-cuda", "bad-device", "bad-dtype"],
)  # fmt: skip
def test_bad_device_or_dtype_is_a_usage_error(command, args, message, tmp_path, capsys) -> None:
    extra = {"edit": ["--prompt", "x", "-o", str(tmp_path / "o.png")], "bench-step": [],
             "profile": ["-o", str(tmp_path / "p.json")]}[command]  # fmt: skip
    assert main([command, "--model", "sd2-inpaint:tiny", *args, *extra]) == EXIT_INVALID_INPUT
    assert f"invalid input: {message}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _dirty(tmp_path):
    """An existing file and a file where a directory is expected."""
    (tmp_path / "old.png").write_bytes(b"keep me")
    (tmp_path / "file").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize(
    "output, message",
    [(".", "is a directory"), ("file/o.png", "'file' is not a directory"),
     ("o.txt", "'.txt' is not an image file suffix"),
     # a missing directory is not made (a typo would silently grow a tree)
     ("nodir/o.png", "directory 'nodir' does not exist (create it first)"),
     ("/nonexistent/dir/e.png", "directory '/nonexistent/dir' does not exist")],
)  # fmt: skip
def test_edit_refuses_an_unusable_output_before_any_model_work(
    output, message, tmp_path, capsys, monkeypatch
) -> None:
    from instgenie.engine.pipeline import EditPipeline

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(EditPipeline, "load", never)
    monkeypatch.chdir(_dirty(tmp_path))
    assert main(["edit", "--prompt", "x", "-o", output]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert "invalid input: output: " in err and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old.png"]


def test_edit_output_is_written_whole_or_not_at_all(tmp_path) -> None:
    """A write that fails (here: a file-size limit) exits 2 naming the output, leaves no partial
    file and keeps an older file at that path."""
    _dirty(tmp_path)
    code = (
        "import resource, sys; from instgenie.cli import main; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY)); "
        "sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "edit", "--model", "sd2-inpaint:tiny", "--steps", "1",
         "--prompt", "x", "--no-paste-back", "-o", str(tmp_path / "old.png")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == EXIT_INVALID_INPUT, r.stderr
    assert "invalid input: output: cannot write" in r.stderr and "File too large" in r.stderr
    assert (tmp_path / "old.png").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old.png"]


def test_profile_refuses_bad_sizes_and_paths_before_profiling(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "sd2-inpaint:tiny", "--load-mb", "-1", "-o", "p.json"])
    assert exc.value.code == 2 and "--load-mb: must be > 0, got -1" in capsys.readouterr().err
    _dirty(tmp_path)
    code = main(["profile", "--model", "sd2-inpaint:tiny", "--disk-dir", str(tmp_path / "file"),
                 "-o", str(tmp_path / "p.json")])  # fmt: skip
    assert code == EXIT_INVALID_INPUT and "disk_dir: " in capsys.readouterr().err
    code = main(["profile", "--model", "sd2-inpaint:tiny", "-o", str(tmp_path / "file/p.json")])
    assert code == EXIT_INVALID_INPUT and "output: " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old.png"]


def test_profile_writes_every_fit_the_planner_and_router_read(tmp_path, capsys) -> None:
    """A whole (small) `instgenie profile` run: compute fits per block class and mode, the DRAM
    load fit, the rest of the step, the loop's stages, and the command and execution settings
    that made them."""
    from instgenie.engine.profiling import check_profile
    from instgenie.scheduler.fits import MODES, STAGES, Profile

    out, disk = tmp_path / "p.json", tmp_path / "scratch" / "disk"  # --disk-dir: made if missing
    code = main(["profile", "--model", "sdxl-inpaint:tiny", "--size", "128", "--batches", "1",
                 "--ratios", "0.2", "1.0", "--warmup", "0", "--iters", "1", "--load-mb", "1", "2",
                 "--disk-dir", str(disk), "--disk-mb", "1", "2", "-o", str(out),
                 "--fused-geglu", "off"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    prof = Profile.load_file(out)
    check_profile(prof, _tiny_family())
    assert all(set(fits) == set(MODES) for fits in prof.compute.values())
    assert set(prof.load) == {"dram", "disk"} and prof.other is not None and prof.other.n == 4
    assert disk.is_dir()
    assert set(prof.stages) == set(STAGES) and all(f.n == 3 for f in prof.stages.values())
    assert [px for px, _ in prof.meta["stage_samples"]["encode"]] == [64**2, 96**2, 128**2]
    assert prof.meta["command"].startswith("instgenie profile --model sdxl-inpaint:tiny")
    assert prof.meta["execution"] == to_dict(ExecConfig(fused_geglu="off"))
    assert "stage               encode" in capsys.readouterr().out


def _tiny_family():
    from instgenie.engine.family import load_family

    return load_family("sdxl-inpaint:tiny")


def test_profile_stages_only_replaces_the_stage_fits_of_a_profile(tmp_path, capsys) -> None:
    """`--stages-only` times the loop's encode/decode at the profile's own size and replaces
    only those fits; it refuses a missing profile and one fitted for another model, leaving the
    file as it was."""
    from instgenie.scheduler.fits import Profile

    committed = Path(__file__).resolve().parents[1] / "profiles"
    base = Profile.load_file(committed / "sdxl-inpaint-tiny-cpu.json")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(dict(base.to_json(), stages={})))
    args = ["profile", "--model", "sdxl-inpaint:tiny", "--stages-only", "--warmup", "0",
            "--iters", "1", "-o", str(path)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    new = Profile.load_file(path)
    assert (new.compute, new.load, new.other, new.blocks) == (
        base.compute, base.load, base.other, base.blocks)  # fmt: skip
    assert {k: f.n for k, f in new.stages.items()} == {"encode": 3, "decode": 3}
    s = base.size
    assert [px for px, _ in new.meta["stage_samples"]["decode"]] == [
        (s // 2) ** 2, (3 * s // 4) ** 2, s * s]  # fmt: skip
    assert "--stages-only" in new.meta["stages_meta"]["command"]
    assert (new.meta["stages_meta"]["device"], new.meta["stages_meta"]["dtype"]) == (
        "cpu", base.dtype)  # fmt: skip
    assert new.meta["command"] == base.meta["command"]  # the compute fits' provenance stays
    code = main([*args[:-1], str(tmp_path / "none.json")])
    assert code == EXIT_INVALID_INPUT
    assert "output: --stages-only adds to an existing profile" in capsys.readouterr().err
    other = tmp_path / "flux.json"
    flux = json.loads((committed / "flux-fill-full-h200.json").read_text())
    other.write_text(json.dumps(dict(flux, device="cpu", dtype=base.dtype)))  # blocks differ
    before = other.read_bytes()
    assert main([*args[:-1], str(other)]) == EXIT_INVALID_INPUT
    assert "fitted for flux-fill:full" in capsys.readouterr().err
    assert other.read_bytes() == before
    # a profile fitted on another device or dtype: its stages would be another machine's
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(dict(base.to_json(), device="cuda:0")))
    assert main([*args[:-1], str(gpu)]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert "device: " in err and "was fitted on cuda:0" in err
    half = tmp_path / "half.json"
    half.write_text(json.dumps(dict(base.to_json(), dtype="float16")))
    before = half.read_bytes()
    assert main([*args[:-1], str(half)]) == EXIT_INVALID_INPUT
    assert "dtype: " in capsys.readouterr().err and half.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "flux.json", "gpu.json", "half.json", "p.json"]  # fmt: skip


def test_worker_command_names_the_bad_field(capsys) -> None:
    for args, message in (
        (["--policy", "nope"], "policy: unknown batching policy 'nope'"),
        (["--model", "nope:tiny"], "model: unknown model family 'nope'"),
        (["--address", "ipc:///nonexistent/dir/w.sock"], "address: cannot bind"),
        (["--model-stages", "nope"], "worker: model_stages: 'nope' is not one of"),
    ):
        assert main(["worker", *args]) == EXIT_INVALID_INPUT, args
        assert f"invalid input: {message}" in capsys.readouterr().err
    for args, message in (
        (["--model-stages", "nope"], "worker: model_stages: 'nope'"),
        (["--policy", "nope"], "policy: unknown batching policy 'nope'"),
        (["--worker-start-timeout-s", "0"], "worker_start_timeout_s: must be > 0"),
        (["--drain-timeout-s", "-1"], "drain_timeout_s: must be >= 0"),
        (["--max-request-cost", "nan"], "max_request_cost: must be >= 0"),  # nan: no limit
        (["--job-ttl-s", "0"], "job_ttl_s: must be > 0"),
    ):
        assert main(["serve", *args]) == EXIT_INVALID_INPUT, args
        assert message in capsys.readouterr().err, args


def test_console_script_on_bundled_sample(tmp_path) -> None:
    exe = shutil.which("instgenie") or f"{sys.executable} -m instgenie.cli"
    out = tmp_path / "sample.png"
    proc = subprocess.run(
        [*exe.split(), "edit", "--model", "sdxl-inpaint:tiny", "--prompt", "a red shirt",
         "--steps", "2", "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert Image.open(out).size == (256, 256)


def test_bench_step_json(capsys) -> None:
    code = main(["bench-step", "--model", "flux-fill:tiny", "--mask-ratio", "0.2", "--batch", "2",
                 "--warmup", "0", "--iters", "1", "--json",
                 "--graph-capture", "always"])  # fmt: skip
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["execution"] == to_dict(ExecConfig(graph_capture="always"))  # what it ran with
    for key in ("flops_masked", "flops_full", "ms_masked", "ms_full"):
        assert row[key] > 0, key
    assert row["batch"] == 2 and row["token_ratio"] == pytest.approx(0.2, abs=0.01)
    # counted, not estimated: the masked step does fewer FLOPs, but more than m of the full step
    assert 0.2 < row["flops_masked"] / row["flops_full"] < 0.6


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mask-ratio", "0"], "must be in (0, 1], got 0.0"),
        (["--mask-ratio", "1.5"], "must be in (0, 1], got 1.5"),
        (["--mask-ratio", "-1"], "must be in (0, 1], got -1.0"),
        (["--mask-ratio", "x"], "'x' is not a number"),
        (["--batch", "0"], "must be >= 1, got 0"),
        (["--iters", "0"], "must be >= 1, got 0"),
        (["--warmup", "-3"], "must be >= 0, got -3"),
    ],
)
def test_bench_step_rejects_bad_arguments(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench-step", "--model", "flux-fill:tiny", *args])
    assert exc.value.code == 2  # argparse's usage error, before any model is loaded
    assert message in capsys.readouterr().err


def test_bench_step_size_must_be_on_the_token_grid(capsys) -> None:
    for size in ("100", "0"):  # 0 is not "the default"
        code = main(["bench-step", "--model", "sd2-inpaint:tiny", "--size", size, "--json"])
        assert code == 2
        err = capsys.readouterr().err
        assert "size" in err and "must be a positive multiple of" in err and f"got {size}" in err


def test_ctrl_c_exits_130_without_a_traceback_or_a_file(tmp_path, capsys, monkeypatch) -> None:
    from instgenie.engine.pipeline import EditPipeline

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(EditPipeline, "load", interrupted)
    assert main(["edit", "--prompt", "x", "-o", str(tmp_path / "o.png")]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_keys_generate_writes_a_private_worker_file_and_its_client_file(tmp_path, capsys) -> None:
    from instgenie.curve import read_client_keys, read_server_keys

    assert main(["keys", "generate", "-o", str(tmp_path / "w.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    server, client = Path(out["server_keys"]), Path(out["client_keys"])
    assert (server.name, client.name) == ("w.json", "w-client.json")
    assert {p.stat().st_mode & 0o777 for p in (server, client)} == {0o600}
    s, c = read_server_keys(server), read_client_keys(client)
    assert s.clients == (c.public,) and c.server == s.public == out["server_public"]
    assert s.secret not in json.dumps(out) and c.secret not in json.dumps(out)
    before = server.read_bytes()  # an existing file is never overwritten
    args = ["keys", "generate", "-o", str(server), "--client-output", str(tmp_path / "c.json")]
    assert main(args) == EXIT_INVALID_INPUT
    assert "never overwritten" in capsys.readouterr().err
    assert server.read_bytes() == before and not (tmp_path / "c.json").exists()


def test_worker_beyond_loopback_needs_private_curve_keys(tmp_path, capsys) -> None:
    assert main(["keys", "generate", "-o", str(tmp_path / "w.json")]) == 0
    capsys.readouterr()
    server, client = tmp_path / "w.json", tmp_path / "w-client.json"
    shared = tmp_path / "shared.json"
    shared.write_bytes(server.read_bytes())
    shared.chmod(0o644)
    remote = ["--address", "tcp://0.0.0.0:7701"]
    for args, message in (
        ([*remote, "--allow-remote"], "curve_keys: tcp://0.0.0.0:7701 is beyond loopback: "
                                      "pass --curve-keys FILE"),
        ([*remote, "--allow-remote", "--curve-keys", str(shared)], "has mode 0644"),
        ([*remote, "--allow-remote", "--curve-keys", str(client)], "expected curve server keys"),
        ([*remote, "--curve-keys", str(server)], "address: refusing non-local address"),
    ):  # fmt: skip
        assert main(["worker", "--model", "sd2-inpaint:tiny", *args]) == EXIT_INVALID_INPUT, args
        err = capsys.readouterr().err
        assert "invalid input: " in err and message in err, (args, err)
