"""The tile variants of GPUs with less shared memory, run on the test GPU by lowering the limit that the
launchers read (CUTEFLASH_SMEM_LIMIT): a T4's 64 KB for the sm70 family, the 99 KB of sm86/sm89/sm120
for sm80."""

import pytest
import torch

from cuteflash import flash_attn_func
from cuteflash._lib import select_family
from helpers import require_support
from test_bwd import check_grads
from test_fwd import make_qkv, run_and_check

pytestmark = pytest.mark.gpu

LIMITS = {"sm70": 65536, "sm80": 101376}
# sm80 backward tiles (tile_config.h) within 99 KB: up to head dim 160 (64 x 64 for 96 and 128). Head
# dims 192-256 (112-144 KB) have none yet and must fail with a clear error.
SM80_BACKWARD_FITS = {64, 96, 128, 160}


@pytest.fixture
def family(monkeypatch):
    family = select_family(torch.device("cuda"))
    monkeypatch.setenv("CUTEFLASH_SMEM_LIMIT", str(LIMITS[family]))
    return family


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_forward(family, head_dim, causal):
    run_and_check(*make_qkv(2, 300, 257, 4, 2, head_dim, torch.float16), causal)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_backward(family, head_dim, causal, deterministic):
    require_support(torch.float16, backward=True)
    q, k, v = make_qkv(2, 300, 257, 4, 2, head_dim, torch.float16)
    if family == "sm80" and head_dim not in SM80_BACKWARD_FITS:  # a clear error, not a failed launch
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
        with pytest.raises(RuntimeError, match=r"needs \d+ bytes of shared memory per block; this GPU offers 101376"):
            out.backward(torch.randn_like(out))
        return
    check_grads(q, k, v, causal, fn=lambda *a, **kw: flash_attn_func(*a, deterministic=deterministic, **kw))
