"""The tile variants of GPUs with less shared memory, run on the test GPU by lowering the limit that the
launchers read (CUTEFLASH_SMEM_LIMIT): a T4's 64 KB and a V100's 96 KB for the sm70 family, the 99 KB of
sm86/sm89/sm120 and an A100's 163 KB for sm80."""

import pytest
import torch

from cuteflash import flash_attn_func

pytestmark = pytest.mark.gpu

# sm80 backward tiles (sm80/tiles.h) within 99 KB: up to head dim 160 (64 x 64 for 96 and 128). Head
# dims 192-256 (112-144 KB) have none yet and must fail with a clear error. An A100 runs them all.
SM80_BACKWARD_FITS_99KB = {64, 96, 128, 160}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_forward(smem_limit, head_dim, causal, make_qkv, run_and_check):
    run_and_check(*make_qkv(2, 300, 257, 4, 2, head_dim, torch.float16), causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_backward(smem_limit, head_dim, causal, deterministic, make_qkv, check_grads, require_support):
    require_support(torch.float16, backward=True)
    family, smem = smem_limit
    q, k, v = make_qkv(2, 300, 257, 4, 2, head_dim, torch.float16)
    if family == "sm80" and smem == 101376 and head_dim not in SM80_BACKWARD_FITS_99KB:  # a clear error
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
        with pytest.raises(RuntimeError, match=rf"needs \d+ bytes of shared memory per block; this GPU offers {smem}"):
            out.backward(torch.randn_like(out))
        return
    check_grads(q, k, v, causal, fn=lambda *a, **kw: flash_attn_func(*a, deterministic=deterministic, **kw))
