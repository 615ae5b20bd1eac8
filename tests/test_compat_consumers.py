"""The import statements that libraries built on flash-attn (and FA3) make, run against this repository's
compatibility packages: each row is a fact about one release of a consumer (its version, its file and the statements
there, read with `git show <tag>:<file>` or from the release's wheel, November 2026; a commit where no release has
the file), so a consumer that imports a name the packages lack fails here, on the CPU, before any GPU runs. What
each name does is tested where it is built (test_compat_api.py, test_compat3.py, test_fused_ops.py, ...)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

CONSUMERS = [
    # (consumer and release, its file, the statements it runs there)
    (
        "TransformerEngine v2.18",
        "transformer_engine/pytorch/attention/dot_product_attention/backends.py",
        "from flash_attn_2_cuda import varlen_bwd as flash_attn_cuda_bwd\n"
        "from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n"
        "from flash_attn.flash_attn_interface import _flash_attn_forward as _flash_attn_fwd\n"
        "from flash_attn.flash_attn_interface import _flash_attn_backward as _flash_attn_bwd\n"
        "from flash_attn.flash_attn_interface import (_flash_attn_varlen_forward as _flash_attn_varlen_fwd,)\n"
        "from flash_attn.flash_attn_interface import (_flash_attn_varlen_backward as _flash_attn_varlen_bwd,)\n"
        "from flash_attn_interface import flash_attn_func as flash_attn_func_v3\n"
        "from flash_attn_interface import flash_attn_varlen_func as flash_attn_varlen_func_v3\n"
        "from flash_attn_interface import flash_attn_with_kvcache as flash_attn_with_kvcache_v3\n"
        "from flash_attn_interface import _flash_attn_forward as _flash_attn_fwd_v3\n"
        "from flash_attn_interface import _flash_attn_backward as _flash_attn_bwd_v3",
    ),
    (
        "TransformerEngine v1.11",
        "transformer_engine/pytorch/attention.py",
        "from flash_attn_2_cuda import varlen_bwd as flash_attn_cuda_bwd\n"
        "from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n"
        "from flash_attn.flash_attn_interface import _flash_attn_varlen_forward as _flash_attn_forward\n"
        "from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as _flash_attn_backward",
    ),
    (
        "diffusers v0.40.0",
        "src/diffusers/models/attention_dispatch.py",
        "from flash_attn import flash_attn_func, flash_attn_varlen_func\n"
        "from flash_attn.flash_attn_interface import _wrapped_flash_attn_backward, _wrapped_flash_attn_forward\n"
        "from flash_attn_interface import flash_attn_func as flash_attn_3_func\n"
        "from flash_attn_interface import flash_attn_varlen_func as flash_attn_3_varlen_func",
    ),
    (
        "verl v0.7.0",
        "verl/utils/attention_utils.py, verl/utils/torch_functional.py",
        "from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input\n"
        "from flash_attn.ops.triton.cross_entropy import cross_entropy_loss\n"
        "from flash_attn.bert_padding import pad_input, unpad_input",
    ),
    (
        "OpenRLHF v0.11.0",
        "openrlhf/models/ring_attn_utils.py, openrlhf/models/utils.py",
        "from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input\n"
        "from flash_attn.utils.distributed import all_gather\n"
        "from flash_attn.ops.triton.cross_entropy import cross_entropy_loss",
    ),
    (
        "xtuner v1.0.1",
        "xtuner/v1/ops/flash_attn/gpu.py, xtuner/v1/ops/flash_attn/__init__.py",
        "from flash_attn.flash_attn_interface import flash_attn_gpu, round_multiple\n"
        "from flash_attn.flash_attn_interface import maybe_contiguous as maybe_contiguous_v2\n"
        "from flash_attn_interface import flash_attn_3_gpu as flash_attn_3_cuda\n"
        "from flash_attn_interface import maybe_contiguous as maybe_contiguous_v3\n"
        "flash_attn_gpu.varlen_fwd, flash_attn_gpu.varlen_bwd",
    ),
    (
        "nanotron v0.5",
        "src/nanotron/models/llama.py, src/nanotron/nn/layer_norm.py",
        "from flash_attn.flash_attn_interface import flash_attn_varlen_func\n"
        "from flash_attn.layers.rotary import RotaryEmbedding as FlashRotaryEmbedding\n"
        "from flash_attn import bert_padding\n"
        "from flash_attn.flash_attn_interface import (flash_attn_varlen_func, flash_attn_with_kvcache,)\n"
        "from flash_attn.ops.triton.layer_norm import layer_norm_fn",
    ),
    (
        "nanotron main 2411b022",
        "src/nanotron/models/qwen.py, src/nanotron/nn/llama3_ring_attention.py, src/nanotron/nn/rotary.py",
        "from flash_attn.modules.mha import flash_attn_varlen_kvpacked_func\n"
        "from flash_attn.flash_attn_interface import (_flash_attn_varlen_forward, _flash_attn_varlen_backward,)\n"
        "from flash_attn.layers.rotary import apply_rotary_emb as flash_apply_rotary_emb\n"
        "from flash_attn.layers.rotary import RotaryEmbedding as OrigFlashRotaryEmbedding",
    ),
    (
        "transformers 4.57.6 ModernBERT",
        "src/transformers/models/modernbert/modeling_modernbert.py",
        "from flash_attn.flash_attn_interface import flash_attn_varlen_qkvpacked_func\n"
        "from flash_attn.layers.rotary import RotaryEmbedding\n"
        "from flash_attn.ops.triton.rotary import apply_rotary",
    ),
    (
        "transformers 5.18.0",
        "src/transformers/modeling_flash_attention_utils.py",
        "from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache\n"
        "from flash_attn.bert_padding import pad_input, unpad_input\n"
        "from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache",
    ),
    (
        "mamba v2.3.2.post1",
        "mamba_ssm/modules/mha.py",
        "from flash_attn import flash_attn_with_kvcache\nfrom flash_attn.layers.rotary import RotaryEmbedding",
    ),
    (
        "flash-attn 2.8.3's own tests",
        "tests/test_flash_attn.py",
        "from flash_attn.bert_padding import pad_input, unpad_input\n"
        "from flash_attn.bert_padding import unpad_input_for_concatenated_sequences, index_first_axis_residual\n"
        "from flash_attn.flash_attn_interface import USE_TRITON_ROCM\n"
        "from flash_attn.layers.rotary import apply_rotary_emb",
    ),
    (
        "LLM training scripts (TinyLlama, composer models)",
        "pretrain scripts",
        "from flash_attn.losses.cross_entropy import CrossEntropyLoss\n"
        "from flash_attn.ops.triton.layer_norm import RMSNorm, rms_norm_fn",
    ),
]

COMPAT3_SRC = Path(__file__).resolve().parents[1] / "compat3" / "src"


@pytest.fixture(scope="module")
def fa3_on_path():
    """FA3's flash_attn_interface importable: installed, or the source tree's (compat3/src)."""
    if importlib.util.find_spec("flash_attn_interface") is None:
        sys.path.append(str(COMPAT3_SRC))


@pytest.mark.parametrize("consumer,path,statements", CONSUMERS, ids=[c[0] for c in CONSUMERS])
def test_consumer_imports(consumer, path, statements, flash_attn_compat, fa3_on_path):
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
