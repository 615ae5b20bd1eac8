"""Test configuration and the helpers the GPU tests share, as fixtures.

GPU tests carry the `gpu` marker and are skipped, with the reason, where they cannot run. The large
parameter sweeps also carry `slow`: `pytest -m "not slow"` is a GPU smoke run of a couple of minutes.
Every GPU check compares with a float64 reference: the kernel's max error must be at most twice that of
PyTorch's attention in the input dtype, plus 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import zlib
from pathlib import Path

import pytest
import torch

from cuteflash import flash_attn_func
from cuteflash.reference import attention_ref

if not torch.cuda.is_available():  # the Triton ops' tests (test_fused_ops.py) run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    from cuteflash import _lib

    if _lib._C is None:
        return f"cuteflash's compiled module is not available: {_lib._C_ERROR}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The error of a launch whose kernel this build does not hold (src/api.cpp, require_kernel); the decoding kernel
# is built with each forward kernel.
_MISSING_KERNEL = re.compile(
    r"no (sm\d+) (forward|backward|decoding) kernel for head dim (\d+) and (\w+) was compiled in"
)


def _missing_kernel(exc: BaseException) -> str | None:
    """The reason to skip a test that failed with exc: a kernel that a partial build (CUTEFLASH_HEADDIMS,
    CUTEFLASH_DTYPES, CUTEFLASH_DIRECTIONS) left out, confirmed absent from the build's kernel list; None
    otherwise, and so for a kernel the build does list (a failure to find it is a bug)."""
    match = _MISSING_KERNEL.search(str(exc))
    if match is None:
        return None
    from cuteflash._lib import build_info

    family, direction, head_dim, dtype = match.groups()
    wanted = (family, {"forward": "fwd", "backward": "bwd", "decoding": "fwd"}[direction], dtype, int(head_dim))
    for kernel in build_info()["kernels"]:
        if (kernel["family"], kernel["direction"], kernel["dtype"], kernel["head_dim"]) == wanted:
            return None
    return f"this build has no {family} {direction} kernel for head dim {head_dim} and {dtype}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that needs a kernel the build left out is reported skipped, with the reason, not failed."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.failed and call.excinfo is not None:
        reason = _missing_kernel(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")


@pytest.fixture(autouse=True)
def _seed_from_node_id(request):
    """Seeds torch's global generators (CPU and CUDA) from the test's node id, so that the random inputs of
    a failing test are drawn again when it is rerun. CUTEFLASH_TEST_SEED (an integer) shifts every seed:
    other draws for the same tests."""
    seed = (zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("CUTEFLASH_TEST_SEED", "0"))) % 2**31
    torch.manual_seed(seed)  # also seeds every CUDA device's generator (lazily where CUDA is not initialized)


# ---- Skips for what the build or the kernel family serving this GPU does not hold.


def _family_entry() -> tuple[str, dict]:
    from cuteflash._lib import build_info, select_family

    family = select_family(torch.device("cuda"))
    return family, build_info()["families"][family]


def _computing_entries() -> tuple[str, list[dict]]:
    """The family serving this GPU and the build's entries of the families that compute its calls: its own, then
    those it hands calls to (the registry's delegate, e.g. sm80 for sm90), where compiled in."""
    from cuteflash import _families
    from cuteflash._lib import build_info

    family, entry = _family_entry()
    entries, delegate = [entry], _families.get(family).delegate
    while delegate is not None:
        if delegate in build_info()["families"]:
            entries.append(build_info()["families"][delegate])
        delegate = _families.get(delegate).delegate
    return family, entries


def _require_support(dtype=None, backward=False) -> None:
    """Skip what the kernel family serving this GPU does not do (bf16 on sm70, e.g. under
    CUTEFLASH_BACKEND=sm70; the backward pass in a forward-only build), nor the family it hands calls to."""
    family, entries = _computing_entries()
    if dtype == torch.bfloat16 and not any("bfloat16" in entry["dtypes"] for entry in entries):
        pytest.skip(f"the {family} family has no bf16 kernels")
    if backward and not any("bwd" in entry["directions"] for entry in entries):
        pytest.skip(f"the {family} family has no backward kernels in this build")


def _require_head_dim(head_dim: int) -> None:
    """Skip a head dim whose kernel this build did not compile for the family serving this GPU, nor for the family
    it hands calls to."""
    from cuteflash._lib import kernel_head_dim

    family, entries = _computing_entries()
    if not any(kernel_head_dim(head_dim) in entry["head_dims"] for entry in entries):
        pytest.skip(f"this build has no {family} kernel for head dim {head_dim}")


# The shared memory of each family's smaller GPUs: a T4 and a V100 (whose 96 KB the largest sm70 backward tile
# fills exactly at head dim 128) for sm70; a T4 for sm75; sm86/89/120 and an A100 for sm80; for sm90 every Hopper
# GPU's 227 KB.
_SMEM_LIMITS = {"sm70": (65536, 98304), "sm75": (65536, 65536), "sm80": (101376, 166912), "sm90": (232448,)}


@pytest.fixture(params=[0, 1], ids=["smallest", "next"])
def smem_limit(request, monkeypatch):
    """(family, limit): the family that serves the test GPU, run as if it had the shared memory per block of a
    smaller GPU of the family (CUTEFLASH_SMEM_LIMIT, which the launchers read to choose their tiles)."""
    family = _family_entry()[0]
    if request.param >= len(_SMEM_LIMITS[family]):
        pytest.skip(f"{family} has no second smaller GPU to imitate")
    monkeypatch.setenv("CUTEFLASH_SMEM_LIMIT", str(_SMEM_LIMITS[family][request.param]))
    return family, _SMEM_LIMITS[family][request.param]


@pytest.fixture
def require_support():
    return _require_support


@pytest.fixture
def require_head_dim():
    return _require_head_dim


# ---- Inputs, references and the 2x rule.


def _poison_cache(*like: torch.Tensor) -> None:
    """Fill memory of the caching allocator with NaN, so that outputs allocated next start as NaN and an
    element the kernel forgets to write fails the finiteness check."""
    blocks = [torch.full_like(t, float("nan")) for t in like]
    del blocks


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def _assert_close_2x(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor) -> None:
    """out's max error against the float64 reference is at most 2x PyTorch's (same dtype) + 1e-5."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite), f"{name}: non-finite values where the reference has none"
    err, pt_err = _max_err(out[finite], ref[finite]), _max_err(pt[finite], ref[finite])
    assert err <= 2 * pt_err + 1e-5, f"{name}: max error {err:.3e} > 2 x PyTorch's {pt_err:.3e} + 1e-5"


def _make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, scale=1.0):
    """Random q, k, v on the GPU in flash-attn's layout (skips a dtype the serving family lacks)."""
    _require_support(dtype)
    g = torch.Generator(device="cuda").manual_seed(torch.randint(0, 2**31, ()).item())
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype, generator=g) * scale
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=dtype, generator=g) * scale
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _run_and_check(q, k, v, causal, fn=flash_attn_func, args=None, softmax_scale=None):
    """Runs the forward pass (fn on args, default flash_attn_func on q, k, v) and checks out and lse
    against the references with the 2x rule. Returns out."""
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale, causal, compute_dtype=torch.float64)
    out_pt, lse_pt = attention_ref(q, k, v, softmax_scale, causal, compute_dtype=q.dtype)
    _poison_cache(out_ref, lse_ref)
    out, lse, none = fn(*(args or (q, k, v)), causal=causal, softmax_scale=softmax_scale, return_attn_probs=True)
    torch.cuda.synchronize()
    assert none is None
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    _assert_close_2x("out", out, out_ref, out_pt)
    _assert_close_2x("lse", lse, lse_ref, lse_pt)
    return out


def _reference_grads(q, k, v, dout, causal, compute_dtype, softmax_scale=None):
    """dq, dk, dv of the reference attention computed in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, softmax_scale=softmax_scale, causal=causal, compute_dtype=compute_dtype)
    out.backward(dout.to(compute_dtype))
    return [t.grad for t in leaves]


def _check_grads(q, k, v, causal, softmax_scale=None, fn=None):
    """The backward pass of fn (default flash_attn_func) for a random dout, each gradient checked against
    the references with the 2x rule."""
    dout = torch.randn_like(q)
    ref = _reference_grads(q, k, v, dout, causal, torch.float64, softmax_scale)
    pt = _reference_grads(q, k, v, dout, causal, q.dtype, softmax_scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = (fn or flash_attn_func)(*leaves, causal=causal, softmax_scale=softmax_scale)
    out.backward(dout)
    for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, ref, pt):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        _assert_close_2x(name, leaf.grad, r, p)


@pytest.fixture
def poison_cache():
    return _poison_cache


@pytest.fixture
def max_err():
    return _max_err


@pytest.fixture
def assert_close_2x():
    return _assert_close_2x


@pytest.fixture
def make_qkv():
    return _make_qkv


@pytest.fixture
def run_and_check():
    return _run_and_check


@pytest.fixture
def reference_grads():
    return _reference_grads


@pytest.fixture
def check_grads():
    return _check_grads


# ---- The flash-attn compatibility package (compat/).

COMPAT_SRC = Path(__file__).resolve().parents[1] / "compat" / "src"


@pytest.fixture(scope="module")  # (the model and process-group fixtures that use it are per module)
def flash_attn_compat():
    """cuteflash's flash_attn package: the installed one, else the source tree's (compat/src, then put on sys.path).
    Skips the tests where the flash_attn that imports is not it (the official flash-attn)."""
    if importlib.util.find_spec("flash_attn") is None and COMPAT_SRC.is_dir():
        sys.path.append(str(COMPAT_SRC))
    try:
        import flash_attn
    except ImportError as e:
        pytest.skip(f"the flash-attn compatibility package cannot be imported: {e}")
    version = getattr(flash_attn, "__version__", "")
    if "+cuteflash" not in version:
        pytest.skip(f"flash_attn {version or '(no version)'} at {flash_attn.__file__} is not cuteflash's package")
    return flash_attn
