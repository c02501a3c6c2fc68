"""The LoRA registry of the API (`/v1/loras`, server/loras.py) and edits that name LoRAs, on a
real `instgenie serve` (sdxl-inpaint:tiny, CPU). Its state database is a file, so the LoRA
directory is the default one beside it (launcher.lora_dir); the last test restarts the server on
it. The workers wait for their LoRAs (--lora-async-steps 0), so an edit with one differs from
the same edit without it."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from instgenie.config import LoraConfig
from instgenie.errors import LoraBaseMismatch, LoraNotFound, ValidationError
from instgenie.lora.targets import model_table
from instgenie.server.errors import ApiError
from instgenie.server.loras import LoraRegistry
from tests.server.test_harness import ServerProcess, decoded, edit_files, image_png, mask_png

MODEL = "sdxl-inpaint:tiny"


def lora_bytes(rank: int = 4, seed: int = 0, skew: int = 0, extra: str | None = None) -> bytes:
    """A PEFT-format LoRA on every `attn1.to_q` of the tiny UNet; `skew` adds to the input
    features (another base model), `extra` names a module the model lacks."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (fin, fout) in model_table(MODEL)["unet"].items():
        if module.endswith("attn1.to_q"):
            state[f"unet.{module}.lora_A.weight"] = torch.randn(rank, fin + skew, generator=g)
            state[f"unet.{module}.lora_B.weight"] = torch.randn(fout, rank, generator=g)
    if extra is not None:
        state[f"unet.{extra}.lora_A.weight"] = torch.randn(rank, 32, generator=g)
        state[f"unet.{extra}.lora_B.weight"] = torch.randn(32, rank, generator=g)
    return save(state)


class Served:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="igs-lora-"))
        self.srv = self.start()

    def start(self) -> ServerProcess:
        # the default model stages ("loop"): the loop encodes prompts with the text LoRAs
        return ServerProcess("--model", MODEL, "--state-db", str(self.root / "server.sqlite3"),
                             "--lora-async-steps", "0", faults=False)  # fmt: skip

    @property
    def dir(self) -> Path:
        return self.root / "loras"

    def files(self) -> set[str]:
        return {p.name for p in self.dir.iterdir()}


def serve_module():
    """A module's server (its own state directory), stopped cleanly at the module's end."""
    s = Served()
    yield s
    try:
        assert s.srv.stop() == 0, s.srv.log()[-3000:]
    finally:
        shutil.rmtree(s.root, ignore_errors=True)


served = pytest.fixture(scope="module")(serve_module)


def post_lora(srv: ServerProcess, data: bytes, name: str | None = None):
    form = {"name": name} if name is not None else {}
    return srv.post("/v1/loras", files={"file": ("style.safetensors", data)}, data=form)


def edit(srv: ServerProcess, loras=None, as_json_text: bool = True):
    data = {"prompt": "a hat", "seed": "7", "num_inference_steps": "2"}
    if loras is not None:
        data["loras"] = json.dumps(loras) if as_json_text else loras
    return srv.post("/v1/edits", files=edit_files(image_png(seed=3), mask_png()), data=data)


def test_register_list_get_idempotent_and_edit(served: Served) -> None:
    srv, data = served.srv, lora_bytes()
    lora_id = hashlib.sha256(data).hexdigest()
    r = post_lora(srv, data, name="style")
    assert r.status_code == 201, r.text
    rec = r.json()
    assert rec["id"] == lora_id and rec["object"] == "lora" and rec["name"] == "style"
    assert (rec["bytes"], rec["rank"], rec["components"]) == (len(data), 4, ["unet"])
    assert rec["layers"] == sum(m.endswith("attn1.to_q") for m in model_table(MODEL)["unet"])
    assert served.files() == {f"{lora_id}.safetensors", f"{lora_id}.json"}
    assert (served.dir / f"{lora_id}.safetensors").read_bytes() == data
    again = post_lora(srv, data, name="other")
    assert again.status_code == 200 and again.json() == rec  # the existing record
    assert srv.get("/v1/loras").json() == {"object": "list", "data": [rec]}
    assert srv.get(f"/v1/loras/{lora_id}").json() == rec
    missing = srv.get(f"/v1/loras/{'0' * 64}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"

    plain = edit(srv)
    assert plain.status_code == 200, plain.text
    with_lora = edit(srv, [{"id": lora_id, "scale": 2.0}])
    assert with_lora.status_code == 200, with_lora.text
    a, b = decoded(plain.json()["image"]), decoded(with_lora.json()["image"])
    assert a.size == b.size and a.tobytes() != b.tobytes()  # the LoRA was applied
    r = srv.post("/v1/edits", json={"image": None, "mask": None, "prompt": "x",
                                   "loras": [{"id": "0" * 64}]})  # fmt: skip
    assert r.status_code == 422 and r.json()["error"]["field"] == "mask"  # JSON lists parse

    files = {"image": ("i.png", image_png(seed=3), "image/png")}
    # OpenAI route: an unknown id is a 404 in OpenAI's shape; malformed JSON a 400
    unknown = json.dumps([{"id": "f" * 64}])
    r = srv.post("/v1/images/edits", files=files, data={"prompt": "x", "loras": unknown})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text
    r = srv.post("/v1/images/edits", files=files, data={"prompt": "x", "loras": "[{"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loras", r.text


def test_edits_naming_unknown_or_bad_loras(served: Served) -> None:
    srv = served.srv
    r = edit(srv, [{"id": "a" * 64}])
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("lora_not_found", "loras")
    for bad in ([{"id": "xyz"}], [{"id": "a" * 64, "scale": 9}], "not json"):
        r = edit(srv, bad, as_json_text=not isinstance(bad, str))
        assert r.status_code == 422 and r.json()["error"]["field"].startswith("loras"), r.text
    r = edit(srv, [{"id": "a" * 64}] * 2)
    assert r.status_code == 422 and "named twice" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x10\x00\x00\x00\x00\x00\x00\x00not a header", "lora_invalid_file"),
        (lora_bytes(skew=16), "lora_wrong_base"),
        (lora_bytes(extra="down_blocks.9.nonexistent.to_q"), "lora_unknown_keys"),
        (lora_bytes(rank=256), "lora_rank_too_large"),
    ],
    ids=["corrupt", "wrong-base", "unknown-keys", "rank"],
)
def test_refused_files_write_nothing(served: Served, data: bytes, code: str) -> None:
    before = served.files()
    r = post_lora(served.srv, data)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == (code, "file"), err
    assert served.files() == before


def test_form_checks(served: Served) -> None:
    srv = served.srv
    r = srv.post("/v1/loras", data={"name": "x"}, files={"other": ("a", b"1")})
    assert r.status_code == 422 and r.json()["error"]["field"] == "other"
    r = srv.post("/v1/loras", json={"file": "x"})
    assert r.status_code == 415
    r = post_lora(srv, lora_bytes(seed=5), name="n" * 201)
    assert r.status_code == 422 and r.json()["error"]["field"] == "name"


def test_delete_and_restart(served: Served) -> None:
    srv = served.srv
    keep, drop = lora_bytes(seed=1), lora_bytes(seed=2)
    keep_id, drop_id = (hashlib.sha256(d).hexdigest() for d in (keep, drop))
    for d in (keep, drop):
        assert post_lora(srv, d).status_code == 201
    r = srv.delete(f"/v1/loras/{drop_id}")
    assert r.json() == {"id": drop_id, "object": "lora", "deleted": True}
    assert not any(n.startswith(drop_id) for n in served.files())
    assert srv.delete(f"/v1/loras/{drop_id}").status_code == 404
    r = edit(srv, [{"id": drop_id}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
    listed = srv.get("/v1/loras").json()["data"]

    assert srv.stop() == 0
    served.srv = srv = served.start()
    assert srv.get("/v1/loras").json()["data"] == listed
    assert srv.get(f"/v1/loras/{keep_id}").json()["name"] == "style.safetensors"
    r = edit(srv, [{"id": keep_id, "scale": 0.5}])
    assert r.status_code == 200, r.text


def test_registry_loads_records_and_drops_orphans(tmp_path: Path) -> None:
    reg = LoraRegistry(tmp_path, MODEL, LoraConfig(), max_loras=8)
    good = "b" * 64
    (tmp_path / f"{good}.safetensors").write_bytes(b"x")
    (tmp_path / f"{good}.json").write_text(json.dumps({"id": good, "name": None}))
    (tmp_path / f"{'c' * 64}.safetensors").write_bytes(b"orphan")
    (tmp_path / f".{good}.json.1234.tmp").write_text("partial")
    (tmp_path / "junk.json").write_text("{")
    assert reg.load() == 1 and set(reg.records) == {good}
    assert {p.name for p in tmp_path.iterdir()} == {
        f"{good}.safetensors",
        f"{good}.json",
        "junk.json",
    }
    assert reg.check([(good, 1.0)]) == [(good, 1.0)]
    with pytest.raises(ApiError) as info:
        reg.check([("d" * 64, 1.0)])
    assert (info.value.status_code, info.value.code) == (404, "lora_not_found")


def test_lora_errors_keep_their_codes() -> None:
    e = ApiError.from_validation(LoraNotFound("loras", "no"))
    assert (e.status_code, e.code, e.field) == (404, "lora_not_found", "loras")
    e = ApiError.from_validation(LoraBaseMismatch("file", "other model"))
    assert (e.status_code, e.code) == (422, "lora_wrong_base")
    assert ApiError.from_validation(ValidationError("x", "y")).code == "invalid_request"


def test_client_cli_lora_commands(served: Served, tmp_path: Path, capsys) -> None:
    """`instgenie client lora add/list/rm` and `client edit --lora ID:SCALE`."""
    from instgenie.cli import main

    url = ["--server", served.srv.url]
    path = tmp_path / "cli.safetensors"
    path.write_bytes(lora_bytes(seed=21))
    assert main(["client", "lora", "add", str(path), "--name", "cli", *url]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["name"] == "cli" and rec["id"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert main(["client", "lora", "list", *url]) == 0
    assert rec["id"] in {r["id"] for r in json.loads(capsys.readouterr().out)["data"]}
    out = tmp_path / "e.png"
    args = ["client", "edit", "--prompt", "x", "--steps", "2", "-o", str(out), *url]
    assert main([*args, "--lora", f"{rec['id']}:1.5"]) == 0
    assert out.is_file()
    assert main([*args, "--lora", f"{'9' * 64}"]) != 0  # unregistered: 404, a usage error
    assert "lora_not_found" in capsys.readouterr().err
    assert main(["client", "lora", "rm", rec["id"], *url]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] is True
