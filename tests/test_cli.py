"""The `instgenie edit` command, in-process and through the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from instgenie.cli import EXIT_INVALID_INPUT, EXIT_MODEL_LOAD, main
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
    assert code == EXIT_MODEL_LOAD
    assert "unknown model family" in capsys.readouterr().err


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
                 "--warmup", "0", "--iters", "1", "--json"])  # fmt: skip
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
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
    code = main(["bench-step", "--model", "sd2-inpaint:tiny", "--size", "100", "--json"])
    assert code == 2
    err = capsys.readouterr().err
    assert "size" in err and "must be a positive multiple of" in err and "got 100" in err
