"""The RMSNorm, SwiGLU and RoPE Triton kernels compile for a GPU (sm_90, Hopper) ahead of time, without one:
``triton.compile`` of each ``@triton.jit`` function to PTX / cubin, in a subprocess without
``TRITON_INTERPRET`` (the interpreter accepts Python that the compiler refuses, e.g. untyped loop counters).
Slow tier: ~45 s on the shared 2-core machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ftitan.kernels import rms_norm as R, swiglu as S, rope as P

def sig(names, types, consts):
    return {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}

rope = ["q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "cos_ptr", "sin_ptr", "T", "HQ", "HK", "HALF"]
cases = [
    (R._fwd_kernel, sig(["x_ptr", "w_ptr", "y_ptr", "rstd_ptr", "D", "eps"], ["*bf16", "*fp32", "*bf16", "*fp32", "i32", "fp32"], ["BLOCK_D"]), {"BLOCK_D": 4096}),
    (R._bwd_kernel, sig(["dy_ptr", "x_ptr", "w_ptr", "rstd_ptr", "dx_ptr", "dw_part_ptr", "M", "D"], ["*bf16", "*bf16", "*fp32", "*fp32", "*bf16", "*fp32", "i32", "i32"], ["BLOCK_D"]), {"BLOCK_D": 4096}),
    (S._fwd_kernel, sig(["g_ptr", "u_ptr", "y_ptr", "N"], ["*fp32"] * 3 + ["i32"], ["BLOCK"]), {"BLOCK": 1024}),
    (S._bwd_kernel, sig(["dy_ptr", "g_ptr", "u_ptr", "dg_ptr", "du_ptr", "N"], ["*bf16"] * 5 + ["i32"], ["BLOCK"]), {"BLOCK": 1024}),
] + [
    (P._rope_kernel, sig(rope, ["*bf16"] * 4 + ["*fp32"] * 2 + ["i32"] * 4, ["PER_BATCH", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BACKWARD"]),
     {"PER_BATCH": per, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64, "BACKWARD": bw})
    for per in (False, True) for bw in (False, True)
]
for fn, signature, consts in cases:
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in compiled.asm and "cubin" in compiled.asm, fn
print("compiled", len(cases))
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "compiled 8" in out.stdout
