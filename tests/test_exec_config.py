"""ExecConfig: the execution switches (attention backend, channels_last, CUDA graphs and their
capture, cuDNN benchmark, fused kernels) as one frozen config. Checked values, one flag per field
on every command that loads a model, the environment read once where a command builds its config
(flag > variable > default) and never at import, and the values reaching the model they load."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from instgenie.config import ExecConfig, ModelConfig, env_overrides, from_dict, to_dict
from tests.conftest import exec_at_start

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(ExecConfig)]
#: a value other than the default for every field
OTHER = {"attention_backend": "sdpa", "channels_last": False, "cuda_graphs": "masked",
         "graph_capture": "always", "cudnn_benchmark": True, "fused_group_norm": "off",
         "fused_geglu": "on", "fused_conv_bias": "off", "png_compression": "small",
         "sparse_convs": "auto", "cropped_decode": "off", "kv_cache": "on"}  # fmt: skip
#: every field's variable set to a value other than the default and than OTHER's
ENV_ELSEWHERE = {"INSTGENIE_ATTENTION_BACKEND": "bogus", "INSTGENIE_UNET_CHANNELS_LAST": "0",
                 "INSTGENIE_CUDA_GRAPHS": "off", "INSTGENIE_GRAPH_CAPTURE": "bogus",
                 "INSTGENIE_CUDNN_BENCHMARK": "maybe", "INSTGENIE_FUSED_GROUPNORM": "on",
                 "INSTGENIE_FUSED_GEGLU": "off", "INSTGENIE_FUSED_CONV_BIAS": "on",
                 "INSTGENIE_PNG_COMPRESSION": "default",
                 "INSTGENIE_SPARSE_CONVS": "bogus", "INSTGENIE_CROPPED_DECODE": "on",
                 "INSTGENIE_KV_CACHE": "bogus"}  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "value"),
    [("attention_backend", "bogus"), ("attention_backend", "SDPA"), ("cuda_graphs", "on"),
     ("graph_capture", "never"), ("fused_group_norm", "yes"), ("fused_geglu", ""),
     ("fused_conv_bias", True), ("channels_last", "off"), ("cudnn_benchmark", 1),
     ("png_compression", 9), ("sparse_convs", "on"), ("cropped_decode", "always"),
     ("kv_cache", "auto")],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(name: str, value) -> None:
    with pytest.raises(ValueError, match=f"^{name}: "):
        ExecConfig(**{name: value})


def test_defaults_and_round_trip_through_the_worker_config() -> None:
    """Worker processes get the values in their config (to_dict / from_dict), not from the
    environment."""
    assert to_dict(ExecConfig()) == {
        "attention_backend": "auto", "channels_last": True, "cuda_graphs": "all",
        "graph_capture": "buckets", "cudnn_benchmark": False, "fused_group_norm": "auto",
        "fused_geglu": "auto", "fused_conv_bias": "auto", "sparse_convs": "off",
        "png_compression": "fast", "cropped_decode": "auto", "kv_cache": "off",
    }  # fmt: skip
    model = ModelConfig(execution=ExecConfig(**OTHER))
    assert from_dict(ModelConfig, json.loads(json.dumps(to_dict(model)))) == model
    assert set(OTHER) == set(FIELDS)


def test_every_model_command_has_a_flag_per_field_and_a_flag_sets_it(clean_env) -> None:
    from instgenie.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("edit", "bench-step", "profile", "worker", "serve"):
        flags = set(sub[command]._option_string_actions)
        for name in FIELDS:
            assert "--" + name.replace("_", "-") in flags, (command, name)
    for name, value in OTHER.items():
        args = _flags({name: value})
        assert exec_at_start(*args) == ExecConfig(**{name: value}), args
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        exec_at_start("--cuda-graphs", "sometimes")


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(clean_env) -> None:
    clean_env.setenv("INSTGENIE_CUDA_GRAPHS", " Masked ")
    clean_env.setenv("INSTGENIE_CUDNN_BENCHMARK", "yes")
    got = exec_at_start()
    assert (got.cuda_graphs, got.cudnn_benchmark, got.graph_capture) == ("masked", True, "buckets")
    got = exec_at_start("--cuda-graphs", "off", "--no-cudnn-benchmark")
    assert (got.cuda_graphs, got.cudnn_benchmark) == ("off", False)
    assert env_overrides(ExecConfig, {"INSTGENIE_UNET_CHANNELS_LAST": "FALSE"}) == {
        "channels_last": False}  # fmt: skip
    for name, value in (("INSTGENIE_CUDNN_BENCHMARK", "maybe"), ("INSTGENIE_CUDA_GRAPHS", "x")):
        with pytest.raises(ValueError, match=name):
            env_overrides(ExecConfig, {name: value})


def test_a_bad_variable_is_a_usage_error_before_any_model_loads(clean_env, capsys) -> None:
    from instgenie.cli import EXIT_INVALID_INPUT, main

    clean_env.setenv("INSTGENIE_GRAPH_CAPTURE", "sometimes")
    assert main(["bench-step", "--model", "sd2-inpaint:tiny"]) == EXIT_INVALID_INPUT
    assert "INSTGENIE_GRAPH_CAPTURE='sometimes'" in capsys.readouterr().err
    # a flag given replaces the variable: it is never parsed
    assert exec_at_start("--graph-capture", "always").graph_capture == "always"


def test_the_loaded_model_follows_its_config_not_the_environment_of_later(clean_env) -> None:
    """Built at start, the config decides; variables set afterwards (even ones that would be
    refused) change nothing in a model loaded from it."""
    from instgenie.engine.family import load_family
    from instgenie.engine.fused_conv import BiasKernelConv2d
    from instgenie.engine.fused_geglu import FusedGEGLU
    from instgenie.engine.fused_norms import FusedGroupNorm

    execution = exec_at_start(*_flags(OTHER))
    for name, value in ENV_ELSEWHERE.items():
        clean_env.setenv(name, value)
    fam = load_family("sd2-inpaint:tiny", execution=execution)
    assert fam.execution == execution == ExecConfig(**OTHER)
    ex = fam.masked
    assert (ex.attention_backend, ex.graphs.mode, ex.graphs.capture) == ("sdpa", "masked", "always")
    for kind, mode in ((FusedGroupNorm, "off"), (FusedGEGLU, "on"), (BiasKernelConv2d, "off")):
        modes = {
            m.mode for p in (fam.backbone, fam.vae) for m in p.modules() if isinstance(m, kind)
        }
        assert modes == {mode}, kind
    assert fam.cropped.mode == "off"


def _flags(values: dict) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, value]
    return out


_IMPORT_THEN_UNSET = """
import os
import instgenie.engine.adapters.sdxl_inpaint, instgenie.engine.attention
import instgenie.engine.fused_conv, instgenie.engine.fused_geglu, instgenie.engine.fused_norms
import instgenie.engine.masked.executor, instgenie.engine.family, instgenie.cli
for name in [k for k in os.environ if k.startswith("INSTGENIE_")]:
    del os.environ[name]
import torch
from diffusers.models.activations import GEGLU
from instgenie.engine.fused_geglu import FusedGEGLU
from instgenie.engine.family import load_family
from instgenie.engine.fused_norms import FusedGroupNorm
g = FusedGEGLU(GEGLU(6, 4))
n = FusedGroupNorm(torch.nn.GroupNorm(2, 4), silu=True)
with torch.no_grad():
    g(torch.randn(3, 6)), n(torch.randn(1, 4, 3, 3))
ex = load_family("sd2-inpaint:tiny").masked
print(g.kernel_calls, n.kernel_calls, ex.graphs.mode, ex.attention_backend)
"""


def test_importing_reads_no_variable() -> None:
    """Variables set while the modules are imported, and gone before any model is built, have
    no effect (fused kernels "on" would run the interpreted kernel on CPU; a bogus backend
    would fail the model load)."""
    env = {**os.environ, **ENV_ELSEWHERE, "INSTGENIE_FUSED_GEGLU": "on", "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_THEN_UNSET], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "0", "all", "auto"], proc.stdout
