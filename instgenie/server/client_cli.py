"""`instgenie client ...`: talk to a running server from the command line (stdlib HTTP only).

    instgenie client edit --prompt "a red silk shirt" -o out/edit.png      # bundled sample
    instgenie client template --image in.png --prompt "a person" --wait
    instgenie client edit --template-id <id> --mask mask.png --prompt "..." -o out.webp
    instgenie client edit --async --prompt "..." -o out.png     # a job; progress bar on stderr
    instgenie client job <job id> [--wait] [-o out.png]          # status, progress, result
    instgenie client cancel <job id>
    instgenie client health

Exit status:
  0    ok (`template` without --wait: the build was accepted and may still be running);
  1    the server failed or could not be reached, a template build failed, a job failed or was
       cancelled, `job -o` found no finished result, or `template --wait` timed out with the
       template still building (the last state is printed);
  2    bad input: a usage error, an unreadable --image/--mask, an unusable -o/--output, or a
       request the server refused (4xx);
  130  interrupted (Ctrl-C); no output file is left behind (`edit --async` also cancels its job).
`edit` checks -o before it sends the request and writes the image atomically (a temporary file
in the same directory, renamed over the target): a failed or interrupted edit leaves no file.
`edit --async` and `job --wait` follow the job's Server-Sent Events (GET /v1/jobs/{id}/events)
and draw `step k/N [####......]` on stderr (one line per step when stderr is not a terminal).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from importlib import resources
from pathlib import Path

from instgenie.errors import ValidationError
from instgenie.outputs import PendingOutput, output_format

DEFAULT_SERVER = "http://127.0.0.1:8000"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
TERMINAL = ("done", "failed", "cancelled")  # a job's last event (server/jobs.py)


class ClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def encode_multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]):
    """(body, content type) of a multipart/form-data body."""
    boundary = "instgenie-" + secrets.token_hex(16)
    out = bytearray()
    for name, value in fields.items():
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        ).encode()
    for name, (filename, data) in files.items():
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def call(
    method: str,
    url: str,
    body: bytes | None = None,
    content_type: str | None = None,
    timeout: float = 900.0,
) -> dict:
    req = urllib.request.Request(url, data=body, method=method)
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise client_error(exc) from None


def client_error(exc: urllib.error.HTTPError) -> ClientError:
    raw = exc.read()
    try:
        err = json.loads(raw)["error"]
        message = f"{err.get('code')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        message = raw[:500].decode(errors="replace")
    return ClientError(exc.code, message)


def _read(path: str | None, sample: str, field: str) -> tuple[str, bytes]:
    """(file name, bytes) of an input file, or of the bundled sample when none is given."""
    if path is None:
        return sample, resources.files("instgenie").joinpath("assets", sample).read_bytes()
    try:
        return Path(path).name, Path(path).read_bytes()
    except OSError as exc:
        raise ValidationError(field, str(exc)) from None  # worded as `instgenie edit` words it


def _seconds(low: float, strict: bool):
    """argparse type: a number of seconds > low (strict) or >= low."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if math.isnan(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {text}"
            )
        return value

    parse.__name__ = "seconds"
    return parse


def wait_ready(server: str, wait_s: float) -> None:
    """Poll GET /ready until it answers 200 (a server still starting refuses connections)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            call("GET", server.rstrip("/") + "/ready", timeout=5)
            return
        except (ClientError, OSError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def job_events(base: str, job_id: str, timeout: float = 60.0):
    """(event, data) of a job's Server-Sent Events until its terminal one; `timeout`: the most
    seconds between two lines (the server sends a keep-alive every 15 s)."""
    req = urllib.request.Request(f"{base}/v1/jobs/{_q(job_id)}/events")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise client_error(exc) from None
    with resp:
        event, data = None, []
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and event is not None:
                yield event, json.loads("\n".join(data) or "{}")
                if event in TERMINAL:
                    return
                event, data = None, []


def _q(job_id: str) -> str:
    """A job id as one URL path segment (an id with '/' or '..' never reaches another route)."""
    return urllib.parse.quote(job_id, safe="")


class ProgressBar:
    """`step k/N [####......]` on `stream`: redrawn in place on a terminal, else a line each."""

    WIDTH = 20  # characters of the bar

    def __init__(self, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.drawn = False

    def show(self, event: str, data: dict) -> None:
        if event == "step" and data.get("num_steps"):
            k, n = int(data["step"]), int(data["num_steps"])
            filled = self.WIDTH * k // n
            text = f"step {k}/{n} [{'#' * filled}{'.' * (self.WIDTH - filled)}]"
        elif event == "queued":
            text = f"queued (position {data.get('position', 0)})"
        elif event in ("running", "stage") and data.get("stage"):
            text = f"running: {data['stage']}"  # preprocess, encode, denoise, decode, ...
        elif event in ("running", *TERMINAL):
            text = event
        else:
            return
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + ("" if self.tty else "\n"))
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def follow(base: str, job_id: str) -> dict:
    """Draw a job's progress from its events until it ends; its final view (GET)."""
    bar = ProgressBar()
    try:
        for event, data in job_events(base, job_id):
            bar.show(event, data)
    finally:
        bar.close()
    return call("GET", f"{base}/v1/jobs/{_q(job_id)}")


def save_image(result: dict, pending: PendingOutput) -> dict:
    """Write an edit response's image; the response without it."""
    result = dict(result)
    try:
        data = base64.b64decode(result.pop("image"), validate=True)
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ValueError("the server's answer carries no valid base64 image") from None
    pending.commit(data)
    return result


def job_outcome(job: dict, out: Path | None, pending: PendingOutput | None) -> int:
    """Print a job's view (its image written to `out`, never printed); the exit status."""
    view = dict(job)
    result = view.get("result")
    if result is not None and pending is not None:
        view["result"] = save_image(result, pending)
        view["output"] = str(out)
    elif result is not None:
        view["result"] = {k: v for k, v in result.items() if k != "image"}
    print(json.dumps(view))
    if job["status"] in ("failed", "cancelled"):
        err = job.get("error") or {}
        print(f"error: job {job['id']} {job['status']}: {err.get('message')}", file=sys.stderr)
        return EXIT_ERROR
    if pending is not None and result is None:
        done, total = job["progress"]["step"], job["progress"]["num_steps"]
        where = f"step {done}/{total}" if total else job.get("stage") or "not started"
        print(
            f"error: job {job['id']} is {job['status']} ({where}); nothing written (--wait "
            "waits for it)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def cmd_edit(args: argparse.Namespace) -> int:
    out = Path(args.output)
    fmt = output_format(out, args.format)
    fields = {"prompt": args.prompt, "seed": str(args.seed), "output_format": fmt}
    if args.steps is not None:
        fields["num_inference_steps"] = str(args.steps)
    if args.guidance is not None:
        fields["guidance_scale"] = str(args.guidance)
    if args.negative_prompt is not None:
        fields["negative_prompt"] = args.negative_prompt
    _lora_field(args, fields)
    files = {"mask": _read(args.mask, "sample_mask.png", "mask")}
    if args.template_id:
        fields["template_id"] = args.template_id
    else:
        files["image"] = _read(args.image, "sample.png", "image")
    body, ctype = encode_multipart(fields, files)
    base = args.server.rstrip("/")
    with PendingOutput(out) as pending:
        if args.is_async:
            job = call("POST", base + "/v1/edits?async=true", body, ctype)
            try:
                job = follow(base, job["id"])
            except KeyboardInterrupt:  # the job would run on without anyone to collect it
                try:
                    call("DELETE", f"{base}/v1/jobs/{_q(job['id'])}", timeout=10)
                except (ClientError, OSError):
                    pass
                raise
            return job_outcome(job, out, pending)
        result = save_image(call("POST", base + "/v1/edits", body, ctype), pending)
    print(json.dumps({"output": str(out), **result}))
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    base = args.server.rstrip("/")
    out = Path(args.output) if args.output else None
    with PendingOutput(out) if out is not None else contextlib.nullcontext() as pending:
        if args.wait:
            job = follow(base, args.job_id)
        else:
            job = call("GET", f"{base}/v1/jobs/{_q(args.job_id)}")
        return job_outcome(job, out, pending)


def cmd_cancel(args: argparse.Namespace) -> int:
    """DELETE /v1/jobs/{id}: a queued or running job is cancelled (a finished one forgotten)."""
    job = call("DELETE", f"{args.server.rstrip('/')}/v1/jobs/{_q(args.job_id)}")
    if job.get("result") is not None:
        job["result"] = {k: v for k, v in job["result"].items() if k != "image"}
    print(json.dumps(job))
    return EXIT_OK


def cmd_template(args: argparse.Namespace) -> int:
    fields = {"prompt": args.prompt, "seed": str(args.seed)}
    if args.steps is not None:
        fields["num_inference_steps"] = str(args.steps)
    _lora_field(args, fields)
    files = {"image": _read(args.image, "sample.png", "image")}
    if args.mask:
        files["mask"] = _read(args.mask, "sample_mask.png", "mask")
    body, ctype = encode_multipart(fields, files)
    base = args.server.rstrip("/")
    result = call("POST", base + "/v1/templates", body, ctype)
    deadline = time.monotonic() + args.timeout
    while args.wait and result["status"] == "building":
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(0.5, left))
        poll_s = max(1.0, min(30.0, deadline - time.monotonic()))
        result = call("GET", f"{base}/v1/templates/{result['id']}", timeout=poll_s)
    print(json.dumps(result))
    if result["status"] == "failed":
        print(f"error: template {result['id']} failed: {result.get('error')}", file=sys.stderr)
        return EXIT_ERROR
    if args.wait and result["status"] != "ready":
        print(
            f"timeout: template {result['id']} still {result['status']} after {args.timeout:g} s",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def _lora_field(args: argparse.Namespace, fields: dict[str, str]) -> None:
    """--lora ID[:SCALE] flags as the `loras` form field (a JSON list)."""
    if args.lora:
        refs = []
        for text in args.lora:
            lora_id, _, scale = text.partition(":")
            refs.append({"id": lora_id, "scale": float(scale) if scale else 1.0})
        fields["loras"] = json.dumps(refs)


def cmd_lora(args: argparse.Namespace) -> int:
    """lora add FILE [--name N] | lora list | lora rm ID."""
    base = args.server.rstrip("/")
    if args.lora_cmd == "add":
        path = Path(args.file)
        fields = {"name": args.name} if args.name else {}
        body, ctype = encode_multipart(fields, {"file": (path.name, path.read_bytes())})
        print(json.dumps(call("POST", base + "/v1/loras", body, ctype, timeout=600)))
    elif args.lora_cmd == "list":
        print(json.dumps(call("GET", base + "/v1/loras")))
    else:
        print(json.dumps(call("DELETE", f"{base}/v1/loras/{_q(args.lora_id)}")))
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    print(json.dumps(call("GET", args.server.rstrip("/") + "/health")))
    return 0


def add_client_parser(sub) -> None:
    client = sub.add_parser("client", help="send requests to a running `instgenie serve`")
    csub = client.add_subparsers(dest="client_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", default=DEFAULT_SERVER, help=f"default {DEFAULT_SERVER}")
        p.add_argument(
            "--wait-ready-s",
            type=_seconds(0.0, strict=False),
            default=0.0,
            help="first wait up to this long, seconds, for the server to be ready",
        )

    edit = csub.add_parser("edit", help="edit an image (or a registered template) under a mask")
    common(edit)
    edit.add_argument("--image", help="image file; default: the bundled sample")
    edit.add_argument("--template-id", help="edit this registered template instead of --image")
    edit.add_argument("--mask", help="mask file, white = edit; default: the sample's mask")
    edit.add_argument("--prompt", required=True)
    edit.add_argument("--negative-prompt", default=None)
    edit.add_argument("--seed", type=int, default=0)
    edit.add_argument("--steps", type=int, default=None)
    edit.add_argument("--guidance", type=float, default=None)
    edit.add_argument(
        "--format",
        choices=["png", "jpeg", "webp"],
        default=None,
        help="default: from the output file's suffix",
    )
    edit.add_argument("-o", "--output", required=True)
    edit.add_argument(
        "--async",
        dest="is_async",
        action="store_true",
        help="run it as a job and draw its progress on stderr (Ctrl-C cancels the job)",
    )
    edit.set_defaults(func=run_client, client_func=cmd_edit)

    job = csub.add_parser("job", help="an async edit's status, progress and result")
    common(job)
    job.add_argument("job_id", metavar="ID", help="job id (job_...), from `edit --async`")
    job.add_argument("--wait", action="store_true", help="follow its progress until it ends")
    job.add_argument("-o", "--output", help="write its image here (the job must be done)")
    job.set_defaults(func=run_client, client_func=cmd_job)

    cancel = csub.add_parser("cancel", help="cancel a queued or running job")
    common(cancel)
    cancel.add_argument("job_id", metavar="ID", help="job id (job_...)")
    cancel.set_defaults(func=run_client, client_func=cmd_cancel)

    tmpl = csub.add_parser("template", help="register a template (its cache builds on the server)")
    common(tmpl)
    tmpl.add_argument("--image", help="template image; default: the bundled sample")
    tmpl.add_argument("--mask", help="optional mask of the region edits will change")
    tmpl.add_argument("--prompt", default="")
    tmpl.add_argument("--seed", type=int, default=0)
    tmpl.add_argument("--steps", type=int, default=None)
    tmpl.add_argument("--wait", action="store_true", help="poll until ready or failed")
    tmpl.add_argument(
        "--timeout",
        type=_seconds(0.0, strict=True),
        default=900.0,
        help="--wait limit, seconds (> 0); still building then: exit status 1",
    )
    tmpl.set_defaults(func=run_client, client_func=cmd_template)

    for p in (edit, tmpl):
        p.add_argument("--lora", action="append", default=[], metavar="ID[:SCALE]",
                       help="apply this registered LoRA (repeatable; scale default 1)")  # fmt: skip
    lora = csub.add_parser("lora", help="register, list or remove LoRAs (POST /v1/loras)")
    lsub = lora.add_subparsers(dest="lora_cmd", required=True)
    add = lsub.add_parser("add", help="register a safetensors LoRA file")
    add.add_argument("file")
    add.add_argument("--name", default=None)
    lsub.add_parser("list", help="the registered LoRAs")
    rm = lsub.add_parser("rm", help="unregister a LoRA")
    rm.add_argument("lora_id", metavar="ID")
    for p in lsub.choices.values():
        common(p)
        p.set_defaults(func=run_client, client_func=cmd_lora)

    health = csub.add_parser("health", help="print the server's /health")
    common(health)
    health.set_defaults(func=run_client, client_func=cmd_health)


def run_client(args: argparse.Namespace) -> int:
    try:
        if args.wait_ready_s > 0:
            wait_ready(args.server, args.wait_ready_s)
        return args.client_func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValidationError as exc:  # unreadable --image/--mask, unusable or unwritable -o
        print(f"invalid input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE if 400 <= exc.status < 500 else EXIT_ERROR
    except (OSError, ValueError) as exc:  # connection refused, bad JSON
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
