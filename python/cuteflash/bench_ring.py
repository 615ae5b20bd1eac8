"""The ring suite of ``python -m cuteflash.bench``: context parallelism over two GPUs with ring-flash-attn (the library
axolotl uses for sequence parallelism) on the flash-attn compatibility package, with nothing of cuteflash's own for
the communication (torch.distributed, NCCL).

- One training step (forward + backward) of zigzag_ring_flash_attn_func (causal) and ring_flash_attn_func (full)
  with the same tokens per GPU on one GPU (a process group of one) and on two (twice the tokens), beside
  flash_attn_func on all the tokens on one GPU.
- A sequence whose score matrix does not fit one GPU (SDPA's math backend runs out of memory on it), split across
  two with the zigzag function: its step time, its peak memory per GPU, and its outputs and gradients against a
  float64 reference computed in blocks of queries. out, lse and dq are held to the 2x rule against PyTorch's
  attention in bf16 (also in blocks: each row is computed as on the whole sequence); dk and dv, which sum over every
  query, against flash_attn_func on the whole sequence on one GPU.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import types

WORLD = 2
STEP_ROWS = [("zigzag_ring_flash_attn_func", True), ("ring_flash_attn_func", False)]  # (function, causal)
STEP_TOKENS = (8192, 32768)  # per GPU, one sequence
STEP_HEADS, STEP_HEAD_DIM = 32, 128
# The math backend's scores of this sequence take 8 * 131072^2 * 2 bytes = 256 GiB; cuteflash's kernels need O(N).
LONG_TOKENS, LONG_HEADS, LONG_HEAD_DIM = 131072, 8, 128
REF_BLOCK = 256  # query rows per block of the references
# ring-flash-attn's modules and the functions each provides.
RING_MODULES = {
    "ring_flash_attn": ["ring_flash_attn_func"],
    "zigzag_ring_flash_attn": ["zigzag_ring_flash_attn_func"],
    "ring_flash_attn_varlen": ["ring_flash_attn_varlen_func"],
    "zigzag_ring_flash_attn_varlen": ["zigzag_ring_flash_attn_varlen_func"],
    "llama3_flash_attn_varlen": ["llama3_flash_attn_varlen_func", "llama3_flash_attn_prepare_cu_seqlens"],
}


def import_ring_flash_attn():
    """The ring_flash_attn package, or None where it is not installed. ring-flash-attn 0.1.8's __init__ imports its
    transformers adapter, which imports a function that transformers 5 removed; the attention functions do not need
    the adapter, so then their modules are loaded alone, under a package of their own."""
    if "ring_flash_attn" in sys.modules:  # imported already, maybe as below (then it has no spec to find)
        return sys.modules["ring_flash_attn"]
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None:
        return None
    try:
        return importlib.import_module("ring_flash_attn")
    except ImportError:
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
        for module, names in RING_MODULES.items():
            loaded = importlib.import_module(f"ring_flash_attn.{module}")
            for name in names:
                setattr(package, name, getattr(loaded, name))
        return package


def shard_positions(lengths, pieces: int, picks):
    """The token positions a rank holds, in its order (on the CPU): each sequence (of these lengths, one after
    another) cut into `pieces` equal chunks, and the chunks `picks` of each."""
    import torch

    held, start = [], 0
    for n in lengths:
        size = n // pieces
        held += [torch.arange(start + p * size, start + (p + 1) * size) for p in picks]
        start += n
    return torch.cat(held)


def zigzag_positions(lengths, rank: int, world: int):
    """The token positions zigzag ring attention gives rank: chunks rank and 2 * world - 1 - rank of 2 * world equal
    chunks of each sequence."""
    return shard_positions(lengths, 2 * world, [rank, 2 * world - 1 - rank])


def why_not(world: int = WORLD) -> str | None:
    """Why the suite (or a test at this world size) cannot run here, or None."""
    import torch
    import torch.distributed as dist

    if torch.cuda.device_count() < world:
        return f"needs {world} GPUs, {torch.cuda.device_count()} visible"
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed has no NCCL"
    if import_ring_flash_attn() is None:
        return "ring-flash-attn is not installed (pip install ring-flash-attn)"
    try:
        import flash_attn
    except ImportError:
        return "the flash-attn compatibility package is not installed (pip install ./compat)"
    if "+cuteflash" not in getattr(flash_attn, "__version__", ""):
        return f"flash_attn {getattr(flash_attn, '__version__', '')} is not cuteflash's compatibility package"
    return None


def _step_ms(step, repeats: int) -> float:
    """Mean milliseconds of step() over `repeats` back-to-back runs, after warm-up."""
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _training_step(fn, tokens: int, heads: int, head_dim: int, **kwargs):
    """A closure running fn's forward and backward on random bf16 inputs of one sequence."""
    import torch

    q, k, v = (
        torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)

    def step():
        torch.autograd.grad(fn(q, k, v, **kwargs), (q, k, v), dout)

    return step


def _step_rows(ring, rank: int, solo, repeats: int) -> list[dict]:
    """STEP_ROWS x STEP_TOKENS: ms of a step on one GPU, on two, and of flash_attn_func on all tokens on one."""
    import torch
    import torch.distributed as dist

    from . import flash_attn_func

    rows = []
    for name, causal in STEP_ROWS:
        fn = getattr(ring, name)
        for tokens in STEP_TOKENS:
            row = {"function": name, "causal": causal, "tokens_per_gpu": tokens}
            shape = (STEP_HEADS, STEP_HEAD_DIM)
            if rank == 0:
                row["one_gpu_ms"] = _step_ms(_training_step(fn, tokens, *shape, causal=causal, group=solo), repeats)
                step = _training_step(flash_attn_func, WORLD * tokens, *shape, causal=causal)
                row["flash_attn_func_all_tokens_ms"] = _step_ms(step, repeats)
                torch.cuda.empty_cache()
            dist.barrier()
            ms = torch.tensor(_step_ms(_training_step(fn, tokens, *shape, causal=causal), repeats), device="cuda")
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # a step ends when its slowest GPU does
            row["two_gpus_ms"] = ms.item()
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _blocked_reference(q, k, v, dout, compute_dtype):
    """Causal attention (out, lse, dq, dk, dv) on the whole sequence in compute_dtype, computed REF_BLOCK queries at a
    time against the keys they see (bottom-right alignment makes each block's rows those of the whole): the score
    matrix never exists whole. dk and dv sum the blocks' parts in float64 (float32 below it)."""
    import torch

    from .reference import attention_ref

    tokens = q.shape[1]
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    out = torch.empty(q.shape, dtype=compute_dtype, device=q.device)
    dq = torch.empty_like(out)
    lse = torch.empty(q.shape[0], q.shape[2], tokens, dtype=acc, device=q.device)
    dk, dv = torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)
    for a in range(0, tokens, REF_BLOCK):
        b = min(a + REF_BLOCK, tokens)
        leaves = [t.to(compute_dtype).requires_grad_() for t in (q[:, a:b], k[:, :b], v[:, :b])]
        block_out, block_lse = attention_ref(*leaves, causal=True, compute_dtype=compute_dtype)
        grads = torch.autograd.grad(block_out, leaves, dout[:, a:b].to(compute_dtype))
        out[:, a:b], lse[..., a:b], dq[:, a:b] = block_out.detach(), block_lse.detach(), grads[0]
        dk[:, :b] += grads[1]
        dv[:, :b] += grads[2]
        del leaves, block_out, block_lse, grads
    return out, lse, dq, dk.to(compute_dtype), dv.to(compute_dtype)


def _math_backend_message(q, k, v) -> str:
    """What SDPA's math backend (plain PyTorch attention) does with the whole sequence on one GPU."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.cuda.synchronize()
        return "ran"
    except torch.OutOfMemoryError as e:
        return ". ".join(str(e).split(". ")[:2])  # "CUDA out of memory. Tried to allocate N GiB"
    finally:
        torch.cuda.empty_cache()


def _long_sequence(ring, rank: int) -> dict:
    """LONG_TOKENS causal tokens split across the GPUs with zigzag ring attention: its step time, its peak memory per
    GPU, and each output's max error against the float64 reference beside its peer's (PyTorch in bf16 for out, lse and
    dq; flash_attn_func on one GPU for dk and dv), the largest over the ranks' tokens."""
    import torch
    import torch.distributed as dist

    from . import flash_attn_func

    g = torch.Generator(device="cuda").manual_seed(0)  # the same inputs on every rank
    shape = (1, LONG_TOKENS, LONG_HEADS, LONG_HEAD_DIM)
    q, k, v, dout = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    result = {"tokens": LONG_TOKENS, "heads": LONG_HEADS, "head_dim": LONG_HEAD_DIM}
    if rank == 0:
        result["math_backend_one_gpu"] = _math_backend_message(q, k, v)
    positions = zigzag_positions([LONG_TOKENS], rank, WORLD).cuda()

    def mine(t):
        return t.index_select(1, positions)

    leaves = [mine(t).requires_grad_() for t in (q, k, v)]
    local_dout = mine(dout)

    def step():
        out, lse, _ = ring.zigzag_ring_flash_attn_func(*leaves, causal=True, return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, leaves, local_dout))

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dist.barrier()
    ms = torch.tensor(_step_ms(step, 3), device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    result["two_gpus_ms"] = ms.item()
    peak = torch.tensor((torch.cuda.max_memory_allocated() - base) / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result["peak_gib_per_gpu"] = peak.item()
    ours = [t.detach() for t in step()]
    torch.cuda.empty_cache()
    one_gpu = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    one_out = flash_attn_func(*one_gpu, causal=True)
    one_grads = torch.autograd.grad(one_out, one_gpu, dout)
    del one_out, one_gpu
    ref = _blocked_reference(q, k, v, dout, torch.float64)
    peers = _blocked_reference(q, k, v, dout, torch.bfloat16)[:3] + one_grads[1:]
    errors = {}
    for name, got, r, peer in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, peers):
        pick = (lambda t: t.index_select(-1, positions)) if name == "lse" else mine
        r = pick(r)
        errors[name] = [(got.double() - r).abs().max().item(), (pick(peer).double() - r).abs().max().item()]
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, errors)
    result["errors"] = {name: [max(e[name][i] for e in gathered) for i in (0, 1)] for name in errors}
    return result


def _worker(rank: int, store_path: str, result_path: str, repeats: int) -> None:
    """One rank of the suite, on GPU `rank`; rank 0 writes the results to result_path (JSON)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    try:
        ring = import_ring_flash_attn()
        solo = dist.new_group([0])  # rank 0 alone: the functions at world size 1
        result = {"steps": _step_rows(ring, rank, solo, repeats), "long": _long_sequence(ring, rank)}
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run(repeats: int) -> dict:
    """The suite's results: {"steps": [...], "long": {...}}, from WORLD processes, one a GPU."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        torch.multiprocessing.spawn(_worker, args=(os.path.join(folder, "store"), path, repeats), nprocs=WORLD)
        with open(path) as f:
            return json.load(f)


def tables(result: dict) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of the two tables."""
    step_rows = [
        ["function", "mask", "tokens per GPU", "1 GPU ms", f"{WORLD} GPUs ms", "ratio", "all tokens, 1 GPU ms"]
    ]
    for r in result["steps"]:
        step_rows.append(
            [
                r["function"],
                "causal" if r["causal"] else "full",
                str(r["tokens_per_gpu"]),
                f"{r['one_gpu_ms']:.2f}",
                f"{r['two_gpus_ms']:.2f}",
                f"{r['two_gpus_ms'] / r['one_gpu_ms']:.2f}",
                f"{r['flash_attn_func_all_tokens_ms']:.2f}",
            ]
        )
    long = result["long"]
    long_rows = [["output", "max error", "peer's", "peer", "2x rule"]]
    for name, (err, peer_err) in long["errors"].items():
        peer = "PyTorch bf16" if name in ("out", "lse", "dq") else "flash_attn_func, 1 GPU"
        ok = err <= 2 * peer_err + 1e-5
        long_rows.append([name, f"{err:.3e}", f"{peer_err:.3e}", peer, "ok" if ok else "FAILED"])
    step_title = (
        f"Ring attention, one step (forward + backward), bf16, {STEP_HEADS} heads of {STEP_HEAD_DIM}: the same tokens "
        f"per GPU on 1 GPU and on {WORLD} (ratio: {WORLD} GPUs / 1; all tokens: flash_attn_func on {WORLD}x the "
        "tokens on 1 GPU)"
    )
    long_title = (
        f"{long['tokens']} tokens, causal, bf16, {long['heads']} heads of {long['head_dim']}, "
        f"zigzag over {WORLD} GPUs: "
        f"{long['two_gpus_ms']:.1f} ms a step, {long['peak_gib_per_gpu']:.2f} GiB peak per GPU; SDPA math on 1 GPU: "
        f"{long['math_backend_one_gpu']}"
    )
    return [(step_title, step_rows), (long_title, long_rows)]


def passed(result: dict) -> bool:
    """Whether each output of the long sequence is within the 2x rule of its peer."""
    return all(err <= 2 * peer + 1e-5 for err, peer in result["long"]["errors"].values())
