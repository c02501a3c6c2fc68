"""Validation of the config tree: a value that cannot work is a ValueError naming its field at
construction (so `instgenie worker`/`serve` can refuse it before starting anything)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from instgenie.config import Config, WorkerConfig, from_dict, to_dict

BAD_WORKER_VALUES = [
    # counts and capacities: below 1 nothing can run (max_batch 0: no request ever joins a batch)
    ("max_batch", 0),
    ("max_batch", -1),
    ("max_queue", 0),
    ("num_pre", 0),
    ("num_post", 0),
    ("max_template_attempts", 0),
    ("step_log_size", 0),
    ("cache_dram_bytes", 0),
    ("cache_dram_bytes", -2),  # -1 = auto (from the machine: cache/budgets.py)
    # durations where 0 would kill/restart a child at once, or spin
    ("start_timeout_s", 0.0),
    ("start_timeout_s", -1.0),
    ("start_timeout_s", math.nan),
    ("heartbeat_interval_s", 0.0),
    ("heartbeat_interval_s", math.nan),
    ("heartbeat_timeout_s", 0.0),
    ("stall_timeout_s", 0.0),
    ("stall_timeout_s", -5.0),
    ("stage_timeout_s", 0.0),
    # 0 means something (restart at once, no disk tier); below 0 does not
    ("restart_backoff_s", -0.1),
    ("cache_disk_bytes", -2),  # -1 = auto
    # the device tier: -1 is auto, 0 off
    ("cache_gpu_bytes", -2),
    # choices
    ("model_stages", "gpu"),
    ("cache_capture_copies", "async"),
    # a timeout no longer than the heartbeat interval kills healthy children
    ("heartbeat_timeout_s", 0.5),
]


@pytest.mark.parametrize(("name", "value"), BAD_WORKER_VALUES)
def test_worker_config_refuses_values_that_cannot_work(name: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        WorkerConfig(**{name: value})
    assert str(value) in str(info.value)
    # the worker processes rebuild their config from JSON: the same check holds there
    data = to_dict(Config())
    data["worker"][name] = value
    with pytest.raises(ValueError, match=rf"^{name}: "):
        from_dict(Config, data)


def test_worker_config_accepts_the_boundaries_and_the_defaults() -> None:
    WorkerConfig()
    edge = WorkerConfig(
        max_batch=1,
        max_queue=1,
        num_pre=1,
        num_post=1,
        max_template_attempts=1,
        step_log_size=1,
        cache_dram_bytes=1,
        cache_disk_bytes=0,  # documented: disables the disk tier
        cache_root="",  # documented: templates in the loop's device memory
        restart_backoff_s=0.0,
        start_timeout_s=0.01,
        heartbeat_interval_s=0.01,
        heartbeat_timeout_s=0.02,
        stall_timeout_s=math.inf,
        stage_timeout_s=0.01,
    )
    assert edge.max_batch == 1
    assert dataclasses.replace(edge, model_stages="process").model_stages == "process"


def test_instgenie_worker_exits_2_on_a_bad_worker_value(capsys, monkeypatch) -> None:
    import instgenie.worker.supervisor
    from instgenie.cli import EXIT_INVALID_INPUT, main

    def started(*args, **kwargs):
        raise AssertionError("a worker was started with max_batch 0")

    monkeypatch.setattr(instgenie.worker.supervisor, "Supervisor", started)  # never hang here
    code = main(["worker", "--model", "sd2-inpaint:tiny", "--max-batch", "0"])
    assert code == EXIT_INVALID_INPUT
    assert "max_batch: must be >= 1, got 0" in capsys.readouterr().err


def test_every_serve_flag_has_help_and_shows_its_default(capsys) -> None:
    """`instgenie serve --help`: each flag's help is its config field's comment (field_help)
    followed by its default."""
    import re

    from instgenie.cli import main
    from instgenie.config import ExecConfig, LimitsConfig, LoraConfig, ModelConfig, field_help
    from instgenie.server.config import ServerConfig

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    blocks = [b.split("\n\n")[0] for b in re.split(r"\n(?=  -)", text) if b.startswith("  --")]
    fields = [f for c in (ModelConfig, ExecConfig, ServerConfig, WorkerConfig, LimitsConfig,
                          LoraConfig)
              for f in dataclasses.fields(c) if f.name not in ("execution", "lora")]  # fmt: skip
    # + --devices, --worker-max-queue; - device, WorkerConfig.max_queue (ModelConfig.execution:
    # ExecConfig's flags)
    assert len(blocks) == len(fields) >= 45
    for block in blocks:
        flag = block.split()[0].rstrip(",")
        words = " ".join(block.split())
        assert re.search(r"\(default: \S.*\)$", words), block
        help_text = re.sub(r"^--\S+( [A-Z_]+)*(, --no-\S+)? ", "", words)
        help_text = re.sub(r" ?\(default: .*\)$", "", help_text)
        assert help_text.strip(), f"{flag} has no help"
    # the help is the comment above the field, whole (argparse wraps it)
    routing = next(b for b in blocks if b.startswith("  --routing"))
    assert " ".join(field_help(ServerConfig)["routing"].split()) in " ".join(routing.split())
    assert "(default: least-loaded)" in " ".join(routing.split())


def test_byte_flags_take_units_and_scientific_notation(capsys) -> None:
    """`--*-bytes` flags read "40e9" or "8GiB" as users write them (issue 24's commands); a
    fraction of a byte or an unknown unit is refused by the parser, saying what it takes."""
    import argparse

    from instgenie.config import WorkerConfig, add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, WorkerConfig)
    args = parser.parse_args(["--cache-dram-bytes", "40e9", "--cache-gpu-bytes", "8GiB",
                              "--cache-disk-bytes", "-1"])  # fmt: skip
    w = dataclass_from_args(WorkerConfig, args)
    assert (w.cache_dram_bytes, w.cache_gpu_bytes, w.cache_disk_bytes) == (40 * 10**9, 8 << 30, -1)
    for bad in ("1.5", "3XB", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--cache-dram-bytes", bad])
        assert "byte" in capsys.readouterr().err
