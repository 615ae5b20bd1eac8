"""ModernBERT (transformers 4.48-4.57, models/modernbert/modeling_modernbert.py) with attn_implementation=
"flash_attention_2" on the compatibility package: its own unpadding, flash_attn_varlen_qkvpacked_func with its
local-attention window, and flash-attn's Triton rotary op (flash_attn.ops.triton.rotary.apply_rotary, in place, with
conjugate=True in its backward pass). A random ModernBERT's masked-LM logits and gradients on a padded batch against
the same model with sdpa, with test_compat_transformers.py's norm rule. transformers 5 removed ModernBERT's flash
path (it goes through transformers' generic one, which test_compat_transformers.py tests)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=3,  # global attention in layer 0, local (window 32) in the others
    num_attention_heads=4,
    max_position_embeddings=256,
    global_attn_every_n_layers=3,
    local_attention=32,
    initializer_range=0.06,
    pad_token_id=0,
    reference_compile=False,  # no torch.compile of its MLP
    repad_logits_with_grad=True,  # flash_attention_2's padded logits keep their gradient
)


@pytest.fixture(scope="module")
def modernbert(flash_attn_compat, tmp_path_factory):
    if not hasattr(transformers, "ModernBertForMaskedLM") or not transformers.__version__.startswith("4."):
        pytest.skip(f"needs transformers 4.48-4.57 (ModernBERT's own flash path); this is {transformers.__version__}")
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip("transformers does not see the flash-attn distribution (pip install ./compat)")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("modernbert")
    transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**CONFIG)).save_pretrained(path)
    return path


def _run(path, implementation: str, dtype: torch.dtype, input_ids, mask):
    """The logits at the unpadded positions and the gradients of every parameter (of their sum against fixed
    weights), float64."""
    model = transformers.ModernBertForMaskedLM.from_pretrained(path, attn_implementation=implementation, dtype=dtype)
    model = model.to("cuda").train()
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    valid = logits[mask.bool()] if logits.dim() == 3 else logits  # flash_attention_2 may return the unpadded rows
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = torch.randn(valid.shape, device="cuda", generator=g, dtype=torch.float64)
    (valid.double() * weights).sum().backward()
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return valid.detach().double(), grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_padded_batch_matches_sdpa(modernbert, dtype, require_support):
    require_support(dtype, backward=True)
    import test_compat_transformers as common

    lengths, seqlen = [96, 57, 13], 96
    input_ids = torch.randint(5, CONFIG["vocab_size"], (len(lengths), seqlen), device="cuda")
    mask = (torch.arange(seqlen, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]).long()
    input_ids = input_ids.masked_fill(mask == 0, CONFIG["pad_token_id"])
    ours = _run(modernbert, "flash_attention_2", dtype, input_ids, mask)
    peer = _run(modernbert, "sdpa", dtype, input_ids, mask)
    reference = _run(modernbert, "sdpa", torch.float64, input_ids, mask)
    common.assert_norm_2x("logits", ours[0], reference[0], peer[0])
    common.assert_norm_2x("gradients", ours[1], reference[1], peer[1])
