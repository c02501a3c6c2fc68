"""Registered LoRAs: `POST/GET/DELETE /v1/loras`, and the check of an edit's `loras`.

A LoRA is registered by uploading its safetensors file: it is parsed and checked against the
served model (instgenie/lora: files.read_lora, targets.conform) off the event loop, then stored
as `<lora_dir>/<id>.safetensors` (id = sha256 of the bytes, hex), which every worker reads, plus
a JSON sidecar `<id>.json` with its record. Both are written atomically (a temporary file
renamed), the file before the sidecar; at start the records are read back from the sidecars
(a file without its sidecar - a registration or deletion cut short - is removed).
Invariants: nothing is written for a file that fails its checks (typed LoRA error: 422 with its
code); registering the same bytes again returns the existing record (200; new: 201); a LoRA
a registered template was captured with is not deleted (409 lora_in_use, TemplateRegistry).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from instgenie.config import LoraConfig
from instgenie.errors import LoraNotFound, ValidationError
from instgenie.lora.store import check_refs, lora_path
from instgenie.server.errors import ApiError, printable
from instgenie.server.schemas import ERRORS, DeletedResponse, LoraList, LoraResponse
from instgenie.server.uploads import read_form

log = logging.getLogger("instgenie.server")
router = APIRouter(tags=["native"])

MAX_NAME_CHARS = 200


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LoraRegistry:
    """The registered LoRAs of one server, by id; `directory` None: LoRAs are not served."""

    def __init__(self, directory: Path | None, model_id: str, cfg: LoraConfig, max_loras: int):
        self.directory = directory
        self.model_id = model_id
        self.cfg = cfg
        self.max_loras = max_loras
        self.records: dict[str, dict] = {}
        self._lock = asyncio.Lock()

    def load(self) -> int:
        """Read the records back from the directory; how many."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        for tmp in self.directory.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        for side in sorted(self.directory.glob("*.json")):
            try:
                rec = json.loads(side.read_text())
                path = lora_path(self.directory, rec["id"])
            except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
                log.warning("LoRA record %s unreadable, skipped: %s", side, exc)
                continue
            if side.stem != rec["id"] or not path.is_file():
                log.warning("LoRA record %s has no file %s, skipped", side, path.name)
                continue
            self.records[rec["id"]] = rec
        for path in self.directory.glob("*.safetensors"):
            if path.stem not in self.records and not path.with_suffix(".json").exists():
                log.warning("LoRA file %s has no record (registration cut short): removed", path)
                path.unlink(missing_ok=True)
        return len(self.records)

    def _directory(self, field: str) -> Path:
        if self.directory is None:
            raise ApiError.invalid(field, "this server serves no LoRAs (no lora_dir)",
                                   "loras_disabled")  # fmt: skip
        return self.directory

    def get(self, lora_id: str) -> dict:
        rec = self.records.get(lora_id)
        if rec is None:
            raise ApiError(404, "lora_not_found", f"no LoRA {lora_id[:64]!r} is registered", "id")
        return rec

    def check(self, refs) -> list[tuple[str, float]]:
        """An edit's `loras` as [(id, scale), ...]: well-formed, within the limit, registered."""
        if not refs:
            return []
        try:
            refs = check_refs(refs, self.cfg.lora_max_per_request)
        except ValidationError as exc:
            raise ApiError.from_validation(exc) from None
        self._directory("loras")
        for lora_id, _ in refs:
            if lora_id not in self.records:
                raise ApiError.from_validation(LoraNotFound(
                    "loras", f"no LoRA {lora_id} is registered (POST /v1/loras first)"
                ))  # fmt: skip
        return list(refs)

    def _validate(self, data: bytes) -> dict:
        """The record of a file that passes the checks (runs in a thread); typed LoraError
        otherwise. The UNet config is not passed: kohya files with SGM-style (non-diffusers)
        SDXL block names may then be refused as lora_unknown_keys."""
        from instgenie.engine.family import ModelSpec, _registry
        from instgenie.lora.files import read_lora
        from instgenie.lora.targets import conform, model_table

        cls = _registry()[ModelSpec.parse(self.model_id).family].pipeline_cls
        weights = conform(read_lora(data, cls), model_table(self.model_id), self.cfg.lora_max_rank)
        return {
            "rank": weights.max_rank,
            "layers": len(weights.layers),
            "components": sorted(weights.components),
        }

    async def register(self, data: bytes, name: str | None) -> tuple[dict, bool]:
        """(the record, created now)."""
        directory = self._directory("file")
        lora_id = hashlib.sha256(data).hexdigest()
        async with self._lock:
            old = self.records.get(lora_id)
            if old is not None:
                return old, False
            if len(self.records) >= self.max_loras:
                raise ApiError(409, "too_many_loras",
                               f"{len(self.records)} LoRAs are registered (the limit, "
                               "--max-loras); DELETE one first")  # fmt: skip
            try:
                facts = await asyncio.to_thread(self._validate, data)
            except ValidationError as exc:
                raise ApiError.from_validation(exc) from None
            rec = {"id": lora_id, "object": "lora", "name": name, "bytes": len(data),
                   "created": int(time.time()), **facts}  # fmt: skip
            path = lora_path(directory, lora_id)
            side = json.dumps(rec).encode()
            await asyncio.to_thread(_write_atomic, path, data)
            await asyncio.to_thread(_write_atomic, path.with_suffix(".json"), side)
            self.records[lora_id] = rec
            log.info("LoRA %s registered (%d layers, rank %d)", lora_id[:12], rec["layers"],
                     rec["rank"])  # fmt: skip
            return rec, True

    async def delete(self, lora_id: str) -> dict:
        async with self._lock:
            rec = self.get(lora_id)
            path = lora_path(self._directory("id"), lora_id)
            path.with_suffix(".json").unlink(missing_ok=True)  # the record first: see load()
            path.unlink(missing_ok=True)
            del self.records[lora_id]
            return rec


def _registry(request: Request) -> LoraRegistry:
    return request.app.state.runtime.loras


@router.post(
    "/v1/loras",
    response_model=LoraResponse,
    status_code=201,
    responses=ERRORS,
    openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary",
                     "description": "the LoRA, a .safetensors file"},
            "name": {"type": "string", "maxLength": MAX_NAME_CHARS,
                     "description": "a name to show (default: the file's name)"},
        }}}}}},
    summary="Register a LoRA (checked against the served model); 200 if already registered",
)  # fmt: skip
async def create_lora(request: Request) -> JSONResponse:
    reg = _registry(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type",
                       f"content-type: {ctype or 'none'!r}; send multipart/form-data with the "
                       "file as the part `file`")  # fmt: skip
    form = await read_form(request, request.app.state.runtime.cfg)
    data, name = None, None
    for key, value in form.multi_items():
        if key == "file" and isinstance(value, UploadFile) and data is None:
            data = await value.read()
            name = name or (printable(value.filename)[:MAX_NAME_CHARS] if value.filename else None)
        elif key == "name" and isinstance(value, str):
            name = value
        else:
            raise ApiError.invalid(key, "is not a field of this route (file, name), or is "
                                   "given twice or as the wrong kind of part")  # fmt: skip
    if data is None:
        raise ApiError.invalid("file", "the .safetensors file (a file part) is required")
    if name is not None:
        if printable(name) != name or "\x00" in name:
            raise ApiError.invalid("name", "is not valid Unicode text", "invalid_text")
        if len(name) > MAX_NAME_CHARS:
            raise ApiError.invalid("name", f"is {len(name)} characters; the limit is "
                                   f"{MAX_NAME_CHARS}")  # fmt: skip
    rec, created = await reg.register(data, name or None)
    return JSONResponse(rec, status_code=201 if created else 200)


@router.get("/v1/loras", response_model=LoraList, summary="List registered LoRAs")
async def list_loras(request: Request) -> dict:
    recs = sorted(_registry(request).records.values(), key=lambda r: (r["created"], r["id"]))
    return {"object": "list", "data": recs}


@router.get("/v1/loras/{lora_id}", response_model=LoraResponse, responses=ERRORS,
            summary="A registered LoRA")  # fmt: skip
async def get_lora(request: Request, lora_id: str) -> dict:
    return _registry(request).get(lora_id)


@router.delete("/v1/loras/{lora_id}", response_model=DeletedResponse, responses=ERRORS,
               summary="Unregister a LoRA and remove its file (409 while a template uses "
               "it)")  # fmt: skip
async def delete_lora(request: Request, lora_id: str) -> dict:
    reg = _registry(request)
    reg.get(lora_id)  # 404 first
    # 409 lora_in_use while a registered template was captured with it
    templates = request.app.state.runtime.templates
    rec = await templates.unless_lora_used(lora_id, lambda: reg.delete(lora_id))
    return {"id": rec["id"], "object": "lora", "deleted": True}
