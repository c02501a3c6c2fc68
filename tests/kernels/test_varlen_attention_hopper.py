"""The Gluon Hopper attention kernel compiles for sm_90 on a machine without a GPU.

Gluon kernels have no interpreter, so CPU runs cannot execute it; its numerics are tested on the
device (tests/kernels/test_varlen_attention.py::TestGpu, which it serves for head dim 128 there).
Here it is compiled ahead of time for an H100/H200 target with the installed Triton and ptxas, and
the machine code is checked for what the design depends on:

* warp specialization (a producer and consumer partitions) in the Triton GPU IR;
* every tensor-core instruction a 64 x 128 x 16 warp-group MMA with fp32 accumulation, 96 of
  them: per consumer 8 for the first key tile's scores (K = 128 in steps of 16), 16 + 16 for the
  loop body and the peeled last key tile (scores and PV), 8 for the last PV product; 2 consumers;
* intra-warp-group overlap: a wait that leaves one MMA group in flight (``DEPBAR.LE gsb0, 0x1``:
  the PV product of the previous tile runs while the softmax of the current one is computed);
* shared memory within the 227 KiB an sm_90 block can have; no register spills (no local
  memory) with Triton 3.6, the version the wrapper dispatches it with.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

REPO = Path(__file__).resolve().parents[2]
_SM90_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90

# Compiled in a child process without TRITON_INTERPRET: the CPU suite sets it (scripts/test.sh)
# before triton is imported, which turns the triton.language functions Gluon reuses (gl.max,
# gl.sum, ...) into interpreted ones that the real compiler rejects.
_COMPILE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton_kernels import varlen_attention as va
    from triton_kernels.varlen_attention_hopper import _varlen_attention_hopper_kernel

    dt, out = sys.argv[1], Path(sys.argv[2])
    sig = {name: "*" + dt for name in ("Q", "K", "V", "O")}
    sig.update(CU_Q="*i32", CU_K="*i32", qk_scale="fp32", n_req="i32")
    for name in ("qn", "qh", "kn", "kh", "vn", "vh", "on", "oh"):
        sig["stride_" + name] = "i32"
    consts = dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=128, STAGES=2, BLOCK_B=8, CONSUMER_REGS=240)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    src = GluonASTSource(fn=_varlen_attention_hopper_kernel, signature=sig,
                         constexprs={(names.index(k),): v for k, v in consts.items()})
    # The launch options of triton_kernels/varlen_attention.py::_launch_gluon.
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "maxnreg": 168})
    (out / "kernel.cubin").write_bytes(k.asm["cubin"])
    (out / "kernel.ttgir").write_text(k.asm["ttgir"])
    (out / "meta.json").write_text(json.dumps({
        "num_warps": k.metadata.num_warps, "shared": k.metadata.shared,
        "dispatched": va._GLUON_VALIDATED}))
""")


def _nvidia_tool(name: str) -> Path:
    import triton.backends.nvidia as nv

    path = Path(nv.__file__).parent / "bin" / name
    if not path.exists():
        pytest.skip(f"this triton build has no {name}")
    return path


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=str)
def compiled(request, tmp_path_factory):
    """(dtype, metadata, Triton GPU IR, SASS) of the kernel compiled for sm_90."""
    out = tmp_path_factory.mktemp("sm90")
    dt = {torch.float16: "fp16", torch.bfloat16: "bf16"}[request.param]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, dt, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    sass = subprocess.run(
        [str(_nvidia_tool("cuobjdump")), "-sass", str(out / "kernel.cubin")],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    meta = json.loads((out / "meta.json").read_text())
    return request.param, meta, (out / "kernel.ttgir").read_text(), sass


def test_warp_specialized(compiled) -> None:
    _, meta, ttgir, _ = compiled
    assert "ttg.warp_specialize" in ttgir
    # 2 consumer warp groups + the producer's warp, rounded up to whole warp groups.
    assert meta["num_warps"] == 12


def test_tensor_core_instructions(compiled) -> None:
    dtype, _, _, sass = compiled
    mmas = re.findall(r"\bHGMMA\.[\w.]+", sass)
    # cuobjdump leaves fp16 operands implicit ("HGMMA.64x128x16.F32") and names bf16 ones.
    want = {"HGMMA.64x128x16.F32.BF16"} if dtype == torch.bfloat16 else {
        "HGMMA.64x128x16.F32", "HGMMA.64x128x16.F32.F16"}  # fmt: skip
    assert mmas and set(mmas) <= want, sorted(set(mmas))
    assert len(mmas) == 96


def test_pv_product_overlaps_softmax(compiled) -> None:
    _, _, _, sass = compiled
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


def test_shared_memory_fits(compiled) -> None:
    _, meta, _, _ = compiled
    assert 0 < meta["shared"] <= _SM90_MAX_SHARED


def test_no_register_spills(compiled) -> None:
    _, meta, _, sass = compiled
    if not meta["dispatched"]:
        # Triton 3.9 compiles the kernel with 128 bytes of stack (spills); the wrapper runs it
        # only with the Triton version it was measured with (3.6: no local memory at all).
        pytest.skip(f"the kernel is dispatched only with triton 3.6, not {triton.__version__}")
    assert not re.search(r"\b(STL|LDL)\b", sass), "registers spill to local memory"
