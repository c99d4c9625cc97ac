"""rms_norm against transformers' LlamaRMSNorm."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ftitan import nn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rmsnorm_bitwise(dtype):
    # same float32 statistics, same cast order: bitwise equal when weight and input share a dtype
    x = (torch.randn(3, 5, 64) * 3 + 1).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        want = ref(x)
    got = nn.rms_norm(x, ref.weight.detach(), 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rms_norm_keeps_activation_dtype_with_fp32_weights():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert nn.rms_norm(x, torch.ones(8), 1e-6).dtype == torch.bfloat16


def test_rms_norm_output_has_unit_rms():
    x = torch.randn(4, 128) * 10
    y = nn.rms_norm(x, torch.ones(128), 1e-6)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), rtol=1e-5, atol=0)
