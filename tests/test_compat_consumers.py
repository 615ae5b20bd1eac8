"""The import statements that libraries built on flash-attn make, run against this repository's compatibility
package: each row is a fact about a consumer (its file and the statements there, read from public copies of its
source in November 2026; not yet pinned to release versions), so a consumer that imports a name the package lacks
fails here, on the CPU, before any GPU runs. What each name does is tested where it is built (test_compat_api.py,
test_bert_padding.py, ...)."""

from __future__ import annotations

import importlib
import textwrap

import pytest

CONSUMERS = [
    # (consumer, its file, the statements it runs there)
    (
        "TransformerEngine",
        "transformer_engine/pytorch/attention/dot_product_attention/backends.py",
        "from flash_attn_2_cuda import varlen_bwd as flash_attn_cuda_bwd\n"
        "from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n"
        "from flash_attn.flash_attn_interface import _flash_attn_varlen_forward as _flash_attn_forward\n"
        "from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as _flash_attn_backward",
    ),
    (
        "diffusers",
        "src/diffusers/models/attention_dispatch.py",
        "from flash_attn import flash_attn_func, flash_attn_varlen_func\n"
        "from flash_attn.flash_attn_interface import _wrapped_flash_attn_backward, _wrapped_flash_attn_forward",
    ),
    (
        "verl",
        "verl/utils/attention_utils.py",
        "from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input",
    ),
    (
        "OpenRLHF",
        "openrlhf/models/ring_attn_utils.py",
        "from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input\n"
        "from flash_attn.utils.distributed import all_gather",
    ),
    (
        "xtuner v1",
        "xtuner/v1/ops/flash_attn/gpu.py",
        "from flash_attn.flash_attn_interface import flash_attn_gpu, maybe_contiguous, round_multiple\n"
        "flash_attn_gpu.varlen_fwd, flash_attn_gpu.varlen_bwd",
    ),
    (
        "nanotron",
        "src/nanotron/models/llama.py",
        "from flash_attn.modules.mha import flash_attn_varlen_kvpacked_func",
    ),
    (
        "transformers 4.57 ModernBERT",
        "src/transformers/models/modernbert/modeling_modernbert.py",
        "from flash_attn.flash_attn_interface import flash_attn_varlen_qkvpacked_func\n"
        "from flash_attn.layers.rotary import RotaryEmbedding\n"
        "from flash_attn.ops.triton.rotary import apply_rotary",
    ),
    (
        "mamba",
        "mamba_ssm/modules/mha.py",
        "from flash_attn.layers.rotary import RotaryEmbedding",
    ),
    (
        "nanotron",
        "src/nanotron/nn/layer_norm.py",
        "from flash_attn.ops.triton.layer_norm import layer_norm_fn",
    ),
    (
        "verl",
        "verl/utils/torch_functional.py",
        "from flash_attn.ops.triton.cross_entropy import cross_entropy_loss",
    ),
    (
        "LLM training scripts (TinyLlama, composer models)",
        "pretrain scripts",
        "from flash_attn.losses.cross_entropy import CrossEntropyLoss\n"
        "from flash_attn.ops.triton.layer_norm import RMSNorm, rms_norm_fn",
    ),
    (
        "flash-attn 2.8.3's own tests",
        "tests/test_flash_attn.py",
        "from flash_attn.bert_padding import pad_input, unpad_input\n"
        "from flash_attn.bert_padding import unpad_input_for_concatenated_sequences, index_first_axis_residual\n"
        "from flash_attn.flash_attn_interface import USE_TRITON_ROCM\n"
        "from flash_attn.layers.rotary import apply_rotary_emb",
    ),
]


@pytest.mark.parametrize("consumer,path,statements", CONSUMERS, ids=[c[0] for c in CONSUMERS])
def test_consumer_imports(consumer, path, statements, flash_attn_compat):
    if "rearrange" in statements:
        pytest.importorskip("einops", reason="flash_attn.bert_padding.rearrange is einops' (not installed here)")
    exec(compile(textwrap.dedent(statements), f"<{consumer}: {path}>", "exec"), {})


def test_flash_attn_path_takes_other_distributions(flash_attn_compat):
    """flash_attn.__path__ extends over every flash_attn folder on sys.path, as flash-attn's does, so that another
    distribution's subpackage (flash-attn-4's flash_attn.cute) imports beside this package."""
    assert isinstance(flash_attn_compat.__path__, list)


def test_generator_slot_must_be_none(flash_attn_compat):
    """flash_attn_gpu's entry points refuse a generator, as flash-attn 2.8.4's do, before touching any tensor."""
    gpu = importlib.import_module("flash_attn.flash_attn_interface").flash_attn_gpu
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        gpu.fwd(None, None, None, None, None, 0.0, 1.0, True, -1, -1, 0.0, False, object())
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        gpu.bwd(*[None] * 10, 0.0, 1.0, True, -1, -1, 0.0, False, object(), None)
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        gpu.varlen_fwd(*[None] * 10, 1, 1, 0.0, 1.0, False, True, -1, -1, 0.0, False, object(), 0)
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        gpu.varlen_bwd(*[None] * 12, 1, 1, 0.0, 1.0, False, True, -1, -1, 0.0, False, object(), None)
