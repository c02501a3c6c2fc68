"""Command line: `instgenie edit | bench-step | profile | worker | keys | serve | client |
loadtest | simulate | dataset`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from importlib import import_module, resources
from pathlib import Path

from instgenie.config import (
    LimitsConfig,
    ModelConfig,
    WorkerConfig,
    add_dataclass_args,
    dataclass_from_args,
    to_dict,
)
from instgenie.errors import EXIT_MODEL_LOAD, InstGenIEError, ModelLoadError, ValidationError
from instgenie.logs import quiet_libraries
from instgenie.outputs import PendingOutput, output_format

EXIT_INVALID_INPUT = 2


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its error message
    return parse


def _mask_ratio(text: str) -> float:
    """A mask ratio in (0, 1]: an edit changes at least one token, at most all of them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


_mask_ratio.__name__ = "mask ratio"


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


_megabytes.__name__ = "size in MB"
_POSITIVE, _NON_NEGATIVE = _int_at_least(1), _int_at_least(0)


def _bench_size(size: int | None, family) -> int:
    """The image side of a benchmark: a positive multiple of the family's token granule (the
    pixel size of a token at the coarsest transformer resolution), so ratios are exact."""
    size = family.default_size if size is None else size
    if size <= 0 or size % family.granule:
        raise ValidationError(
            "size", f"must be a positive multiple of {family.granule} for {family.spec}, got {size}"
        )
    return size


def _model_config(args: argparse.Namespace) -> ModelConfig:
    """The command's ModelConfig from its flags; its execution settings from the flags given,
    else their INSTGENIE_* variables (read here, once), else the defaults."""
    try:
        return dataclass_from_args(ModelConfig, args)
    except ValueError as exc:  # the message names the setting (a field or a variable)
        raise ValidationError("model", str(exc)) from None


def _sample_asset(name: str) -> bytes:
    return resources.files("instgenie").joinpath("assets", name).read_bytes()


def _read(path: str | None, sample: str) -> bytes:
    if path is None:
        return _sample_asset(sample)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValidationError("image" if "mask" not in sample else "mask", str(exc)) from None


def cmd_edit(args: argparse.Namespace) -> int:
    quiet_libraries()
    from instgenie.engine.family import check_model_config, family_options
    from instgenie.engine.pipeline import EditPipeline
    from instgenie.engine.request import EditRequest

    model = _model_config(args)
    check_model_config(model)
    limits = LimitsConfig()
    out = Path(args.output)
    fmt = output_format(out, args.format)
    req = EditRequest(
        uid="cli",
        image=_read(args.image, "sample.png"),
        mask=_read(args.mask, "sample_mask.png"),
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        strength=args.strength,
        height=args.height,
        width=args.width,
        paste_back=args.paste_back,
        output_format=fmt,
    )
    with PendingOutput(out) as pending:  # an unusable -o fails now, not after the model ran
        t0 = time.perf_counter()
        pipe = EditPipeline.load(model.model, device=model.device, dtype=model.dtype,
                                 limits=limits, **family_options(model))  # fmt: skip
        t1 = time.perf_counter()
        state = pipe.preprocess(req)
        t2 = time.perf_counter()
        while not state.is_done:
            pipe.denoise_step([state])
        _sync(model.device)
        t3 = time.perf_counter()
        result = pipe.postprocess([state])[0]
        t4 = time.perf_counter()
        pending.commit(result.data)
    summary = {
        "output": str(out),
        "model": model.model,
        "device": model.device,
        "size": list(result.image.size),
        "mask_ratio": round(result.mask_ratio, 4),
        "num_steps": result.num_steps,
        "load_ms": round(1e3 * (t1 - t0), 1),
        "preprocess_ms": round(1e3 * (t2 - t1), 1),
        "denoise_ms": round(1e3 * (t3 - t2), 1),
        "postprocess_ms": round(1e3 * (t4 - t3), 1),
    }
    print(json.dumps(summary))
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    quiet_libraries()
    from instgenie.engine.family import check_model_config, family_options
    from instgenie.engine.pipeline import EditPipeline
    from instgenie.engine.stepbench import bench_step

    model = _model_config(args)
    check_model_config(model)
    pipe = EditPipeline.load(
        model.model, device=model.device, dtype=model.dtype, **family_options(model)
    )
    size = _bench_size(args.size, pipe.family)
    row = bench_step(pipe, args.mask_ratio, args.batch, size, args.warmup, args.iters)
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:>14}: {v}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.capture_from:  # no model (no torch): a served run's step log prices its captures
        return import_module("instgenie.sim.capture_profile").cmd_capture_from(args)
    quiet_libraries()
    from instgenie.engine.family import check_model_config
    from instgenie.engine.profiling import r2_report

    model = _model_config(args)
    check_model_config(model)
    base = _stages_base(args.output) if args.stages_only else None
    with PendingOutput(Path(args.output)) as pending:  # -o checked before the profiling
        if args.disk_dir and not args.stages_only:
            _disk_dir(args.disk_dir)
        prof = _profile(args, model, pending, base)
    for line in r2_report(prof):
        print(line)
    print(f"wrote {args.output}")
    return 0


def _disk_dir(path: str) -> None:
    """`profile --disk-dir`'s scratch directory: made when missing; a file there is refused."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # FileExistsError: a file at the path (or on the way)
        why = "is not a directory" if isinstance(exc, FileExistsError) else exc.strerror
        raise ValidationError("disk_dir", f"{path!r} {why}") from None


def _stages_base(path: str):
    """The profile `--stages-only` adds its stage fits to (it must exist and parse)."""
    from instgenie.scheduler.fits import Profile

    try:
        return Profile.load_file(path)
    except FileNotFoundError:
        raise ValidationError(
            "output", f"--stages-only adds to an existing profile; {path!r} does not exist"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValidationError("output", f"{path!r} is not a profile: {exc}") from None


def _profile(args: argparse.Namespace, model: ModelConfig, pending: PendingOutput, base=None):
    """Fit a whole profile; with `base` (--stages-only) time only the stages and replace that
    profile's stage fits, after checking it was fitted for this model's blocks."""
    import platform

    import diffusers
    import torch

    from instgenie.engine import profiling as P
    from instgenie.engine.family import family_options
    from instgenie.engine.pipeline import EditPipeline

    if base is not None and torch.device(model.device).type != torch.device(base.device).type:
        raise ValidationError(
            "device", f"{args.output} was fitted on {base.device}; its stages cannot be timed "
            f"on {model.device} (pass --device)",
        )  # fmt: skip
    pipe = EditPipeline.load(
        model.model, device=model.device, dtype=model.dtype, **family_options(model)
    )
    fam = pipe.family
    dtype = str(fam.dtype).removeprefix("torch.")
    if base is not None and dtype != base.dtype:
        raise ValidationError(
            "dtype", f"{args.output} was fitted in {base.dtype}, not {dtype} (pass --dtype)"
        )
    # --stages-only: at the profile's own size unless told
    size = _bench_size(args.size if base is None or args.size is not None else base.size, fam)
    device_name = (
        torch.cuda.get_device_name(fam.device) if fam.device.type == "cuda" else platform.machine()
    )
    meta = {
        "device_name": device_name,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "command": args.command_line,
        "device": str(fam.device),
        "dtype": dtype,
        "execution": to_dict(fam.execution),  # the kernels, layout and graphs it was timed with
    }
    if base is not None:
        try:
            P.check_profile(base, fam, args.output)
        except ValueError as exc:
            raise ValidationError("output", str(exc)) from None
    stages = P.profile_stages(pipe, P.stage_sizes(size, fam.granule), args.warmup, args.iters)
    if base is not None:
        base.set_stages(stages)
        base.meta["stages_meta"] = meta
        prof = base
    else:
        log = lambda m: print(m, file=sys.stderr)  # noqa: E731
        compute = P.profile_compute(pipe, size, args.batches, args.ratios, args.warmup,
                                    args.iters, log=log)  # fmt: skip
        loads = {"dram": P.profile_dram_load(fam.device, args.load_mb)}
        if args.disk_dir:
            loads["disk"] = P.profile_disk_load(args.disk_dir, args.disk_mb)
        meta.update(batches=args.batches, ratios=args.ratios)
        prof = P.fit_profile(model.model, fam.device, fam.dtype, size, compute, loads, meta,
                             stages)  # fmt: skip
    pending.commit(json.dumps(prof.to_json(), indent=1).encode())
    return prof


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker in this process (its children are subprocesses) until SIGTERM/SIGINT."""
    import zmq

    from instgenie.cache.budgets import resolve_cache
    from instgenie.config import Config
    from instgenie.engine.family import check_model_config
    from instgenie.logs import setup_process
    from instgenie.scheduler.batching import get_policy
    from instgenie.worker.supervisor import Supervisor

    try:
        config = Config(
            model=dataclass_from_args(ModelConfig, args),  # execution: flags, else INSTGENIE_*
            limits=dataclass_from_args(LimitsConfig, args),
            worker=dataclass_from_args(WorkerConfig, args),
        )
    except ValueError as exc:
        raise ValidationError("worker", str(exc)) from None
    check_model_config(config.model)  # a typo fails here, not in every child after its start
    try:
        get_policy(config.worker.policy)
    except ValueError as exc:
        raise ValidationError("policy", str(exc)) from None
    if config.worker.profile and not Path(config.worker.profile).is_file():
        raise ValidationError("profile", f"{config.worker.profile!r} is not a file")
    curve = _worker_curve(args)
    setup_process("sup")
    worker, cache = resolve_cache(config.worker)  # "auto": from the machine (cache/budgets.py)
    config = dataclasses.replace(config, worker=worker)
    print(f"instgenie: {cache.describe()}", file=sys.stderr, flush=True)

    def ready(msg) -> None:  # one JSON line on stdout: scripts wait for it
        info = {"event": "ready", "address": sup.address, "pid": msg.pid, "model": msg.model,
                "device": msg.device, "policy": config.worker.policy,
                "execution": to_dict(config.model.execution)}  # fmt: skip
        print(json.dumps(info), flush=True)

    try:
        sup = Supervisor(config, args.address, allow_remote=args.allow_remote, curve=curve,
                         on_ready=ready)  # fmt: skip
    except ValueError as exc:  # a non-local address without --allow-remote and --curve-keys
        raise ValidationError("address", str(exc)) from None
    except zmq.ZMQError as exc:  # in use, or an ipc:// directory that does not exist
        raise ValidationError("address", f"cannot bind {args.address}: {exc}") from None
    return sup.run()


def _worker_curve(args: argparse.Namespace):
    """The worker's curve keys from --curve-keys (a 0600 file of `instgenie keys generate`), or
    None; a non-loopback --address without them is refused before anything starts."""
    from instgenie.curve import read_server_keys
    from instgenie.ipc import is_local

    if args.curve_keys is not None:
        return read_server_keys(args.curve_keys)
    if args.allow_remote and not is_local(args.address):
        raise ValidationError(
            "curve_keys", f"{args.address} is beyond loopback: pass --curve-keys FILE (made by "
            "`instgenie keys generate -o FILE`); clients connect with its client file",
        )  # fmt: skip
    return None


def cmd_keys_generate(args: argparse.Namespace) -> int:
    """Write a new worker (server) key file and its client key file, both mode 0600."""
    from instgenie.curve import CurveKeys, write_key_file

    server = Path(args.output)
    client = Path(args.client_output) if args.client_output else _client_key_path(server)
    if client == server:
        raise ValidationError("client_output", "must differ from -o")
    for path in (server, client):  # both checked before either is written
        if path.exists() or path.is_symlink():
            raise ValidationError("output", f"{str(path)!r} exists; keys are never overwritten")
    keys = CurveKeys.generate()
    write_key_file(server, keys.server_side())
    try:
        write_key_file(client, keys.client_side())
    except BaseException:  # a worker file without its client file would be useless
        server.unlink()
        raise
    print(json.dumps({"server_keys": str(server), "client_keys": str(client),
                      "server_public": keys.server_public}))  # fmt: skip
    return 0


def _client_key_path(server: Path) -> Path:
    """worker.json -> worker-client.json (next to it)."""
    return server.with_name(f"{server.stem}-client{server.suffix or '.json'}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="instgenie", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    edit = sub.add_parser("edit", help="edit one image with a mask and a prompt")
    add_dataclass_args(edit, ModelConfig)
    edit.add_argument("--image", help="template image (PNG/JPEG/WebP); default: bundled sample")
    edit.add_argument("--mask", help="mask, white = edit; default: the bundled sample's mask")
    edit.add_argument("--prompt", required=True)
    edit.add_argument("--negative-prompt", default=None)
    edit.add_argument("--seed", type=int, default=0)
    edit.add_argument("--steps", type=int, default=None, help="default: the family's (50)")
    edit.add_argument("--guidance", type=float, default=None, help="default: the family's")
    edit.add_argument("--strength", type=float, default=1.0)
    edit.add_argument("--height", type=int, default=None)
    edit.add_argument("--width", type=int, default=None)
    edit.add_argument("--paste-back", action=argparse.BooleanOptionalAction, default=True)
    edit.add_argument("--format", choices=["png", "jpeg", "webp"], default=None,
                      help="default: from the output file's suffix")  # fmt: skip
    edit.add_argument("-o", "--output", required=True)
    edit.set_defaults(func=cmd_edit)

    bench = sub.add_parser("bench-step", help="one denoising step, masked vs full: FLOPs and ms")
    add_dataclass_args(bench, ModelConfig)
    bench.add_argument("--mask-ratio", type=_mask_ratio, default=0.2)
    bench.add_argument("--batch", type=_POSITIVE, default=1, help="requests per batch")
    bench.add_argument("--size", type=int, default=None, help="image side; default: the model's")
    bench.add_argument("--warmup", type=_NON_NEGATIVE, default=2)
    bench.add_argument("--iters", type=_POSITIVE, default=5)
    bench.add_argument("--json", action="store_true", help="print one JSON line")
    bench.set_defaults(func=cmd_bench_step)

    prof = sub.add_parser("profile", help="fit per-block compute and per-tier load latency models")
    add_dataclass_args(prof, ModelConfig)
    prof.add_argument("-o", "--output", required=True, help="profile JSON, e.g. profiles/X.json")
    prof.add_argument("--size", type=int, default=None)
    prof.add_argument("--batches", type=_POSITIVE, nargs="+", default=[1, 2, 4, 8])
    prof.add_argument(
        "--ratios", type=_mask_ratio, nargs="+", default=[0.05, 0.1, 0.2, 0.35, 0.5, 1.0]
    )
    prof.add_argument("--warmup", type=_NON_NEGATIVE, default=1)
    prof.add_argument("--iters", type=_POSITIVE, default=3)
    prof.add_argument("--load-mb", type=_megabytes, nargs="+", default=[1, 4, 16, 64, 256])
    prof.add_argument("--disk-dir", default=None, help="profile the disk tier in this directory")
    prof.add_argument("--disk-mb", type=_megabytes, nargs="+", default=[4, 16, 64, 256])
    prof.add_argument(
        "--stages-only", action="store_true",
        help="time only the loop's per-request encode/decode and replace those fits in the "
        "existing profile -o (fitted for this model's blocks)",
    )  # fmt: skip
    prof.add_argument("--capture-from", metavar="STEP_LOG", help="fit only -o's capture cost from "
                      "a served run's step log (serve --step-log); loads no model")  # fmt: skip
    prof.add_argument("--capture-steps", type=_POSITIVE, default=20)
    prof.add_argument("--capture-mask-ratio", type=_mask_ratio, default=0.2)
    prof.set_defaults(func=cmd_profile)

    worker = sub.add_parser("worker", help="run one worker (denoise loop + pre/post processes)")
    worker.add_argument("--address", default="tcp://127.0.0.1:7700",
                        help="ZMQ address clients connect to (ipc:// or loopback tcp)")  # fmt: skip
    worker.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback tcp address (needs --curve-keys)")  # fmt: skip
    worker.add_argument(
        "--curve-keys", default=None, metavar="FILE",
        help="CurveZMQ server keys (a mode-0600 file of `instgenie keys generate`): only clients "
        "holding the matching client keys connect; required beyond loopback",
    )  # fmt: skip
    add_dataclass_args(worker, ModelConfig)
    add_dataclass_args(worker, LimitsConfig)
    add_dataclass_args(worker, WorkerConfig)
    worker.set_defaults(func=cmd_worker)

    keys = sub.add_parser("keys", help="CurveZMQ keys for workers bound beyond loopback")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser("generate", help="write a worker key file and its client key file")
    gen.add_argument("-o", "--output", required=True,
                     help="the worker's (server) key file, for `worker --curve-keys`")  # fmt: skip
    gen.add_argument("--client-output", default=None,
                     help="the clients' key file; default: OUTPUT's name + '-client'")  # fmt: skip
    gen.set_defaults(func=cmd_keys_generate)

    from instgenie.server.commands import add_commands  # serve, client (light imports)

    add_commands(sub)
    from instgenie.tools import add_tool_commands  # loadtest, simulate, dataset, train-reference

    add_tool_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    #: the command as run (recorded in outputs' provenance, e.g. a profile's meta)
    args.command_line = " ".join(["instgenie", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback, and no partial output (PendingOutput)
        print("interrupted", file=sys.stderr)
        return 130
    except ValidationError as exc:
        print(f"invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    except ModelLoadError as exc:
        print(f"model load failed: {exc}", file=sys.stderr)
        return EXIT_MODEL_LOAD
    except InstGenIEError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
