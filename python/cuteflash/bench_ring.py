"""The ring suite of ``python -m cuteflash.bench``: context parallelism over the visible GPUs (2 to 8) with
ring-flash-attn (the library axolotl uses for sequence parallelism) on the flash-attn compatibility package, with
nothing of cuteflash's own for the communication (torch.distributed, NCCL).

- Weak scaling: one training step (forward + backward) of zigzag_ring_flash_attn_func (causal) and
  ring_flash_attn_func (full) with the same tokens per GPU on 1, 2, 4 (8) GPUs. Each GPU's queries attend to W
  times the keys on W GPUs, so the ideal step time is W times one GPU's: the efficiency is W * t_1 / t_W (1.0:
  the communication is hidden, and no time is lost to the ring).
- Strong scaling: a fixed sequence over 1, 2, 4 (8) GPUs; the ideal is t_1 / W, the efficiency t_1 / (W * t_W).
- A sequence whose score matrix does not fit one GPU (SDPA's math backend runs out of memory on it), split across
  every GPU with the zigzag function: its step time, its peak memory per GPU (and the longest sequence that memory
  would allow, extrapolated), and its outputs and gradients against a float64 reference computed in blocks of
  queries. out, lse and dq are held to the 2x rule against PyTorch's attention in bf16 (also in blocks: each row is
  computed as on the whole sequence); dk and dv, which sum over every query, against flash_attn_func on the whole
  sequence on one GPU.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import types

WORLD = 2  # the fewest GPUs the suite runs on; it uses every visible one, up to MAX_WORLD
MAX_WORLD = 8
STEP_ROWS = [("zigzag_ring_flash_attn_func", True), ("ring_flash_attn_func", False)]  # (function, causal)
STEP_TOKENS = (8192, 32768)  # per GPU, one sequence (weak scaling)
STRONG_TOKENS = 65536  # one sequence over 1 to W GPUs (strong scaling)
STEP_HEADS, STEP_HEAD_DIM = 32, 128
# The math backend's scores of this sequence take 8 * 131072^2 * 2 bytes = 256 GiB; cuteflash's kernels need O(N).
LONG_TOKENS, LONG_HEADS, LONG_HEAD_DIM = 131072, 8, 128
REF_BLOCK = 256  # query rows per block of the references
# Steps run before a row is timed: ring-flash-attn merges each ring step's partial output with a TorchScript function,
# which re-profiles and compiles a kernel whenever the shapes it sees change; from 4 GPUs on, a zigzag rank alternates
# between two shapes, and its first ten or so steps are slower. A training run pays that once; the timings exclude it.
WARMUP_STEPS = 12
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
    """Mean milliseconds of step() over `repeats` back-to-back runs, after WARMUP_STEPS."""
    import torch

    for _ in range(WARMUP_STEPS):
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


def world_sizes(world: int) -> list[int]:
    """1, 2, 4, ... up to world: the GPU counts a scaling table has."""
    return [w for w in (1, 2, 4, 8) if w <= world]


def _group_ms(step_of, rank: int, size: int, group, repeats: int) -> float:
    """Milliseconds of a step on the first `size` ranks (group), the slowest of them; the other ranks wait. step_of()
    builds the step on a rank of the group."""
    import torch
    import torch.distributed as dist

    ms = torch.zeros((), device="cuda")
    dist.barrier()
    if rank < size:
        ms.fill_(_step_ms(step_of(), repeats))
        torch.cuda.empty_cache()
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # a step ends when its slowest GPU does
    return ms.item()


def _scaling_rows(ring, rank: int, groups: dict, repeats: int) -> dict:
    """{"weak": [...], "strong": [...]}: STEP_ROWS at STEP_TOKENS per GPU on each group size, and STEP_ROWS at
    STRONG_TOKENS in all on each group size; ms per step by GPU count."""
    shape = (STEP_HEADS, STEP_HEAD_DIM)
    result = {"weak": [], "strong": []}
    for (name, causal), (size, group) in itertools.product(STEP_ROWS, groups.items()):  # NCCL's connections, set up
        fn = getattr(ring, name)
        step_of = functools.partial(_training_step, fn, 1024, *shape, causal=causal, group=group)
        _group_ms(step_of, rank, size, group, 1)
    for name, causal in STEP_ROWS:
        fn = getattr(ring, name)
        for kind, sizes in (("weak", STEP_TOKENS), ("strong", (STRONG_TOKENS,))):
            for tokens in sizes:
                row = {"function": name, "causal": causal, "tokens": tokens, "ms": {}}
                for size, group in groups.items():
                    local = tokens if kind == "weak" else tokens // size

                    step_of = functools.partial(_training_step, fn, local, *shape, causal=causal, group=group)
                    row["ms"][str(size)] = _group_ms(step_of, rank, size, group, repeats)
                result[kind].append(row)
    return result


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


def _long_sequence(ring, rank: int, world: int) -> dict:
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
    positions = zigzag_positions([LONG_TOKENS], rank, world).cuda()

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
    result["world"], result["ms"] = world, ms.item()
    peak = torch.tensor((torch.cuda.max_memory_allocated() - base) / 2**30, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result["peak_gib_per_gpu"] = peak.item()
    # what a rank holds of the sequence itself (its shard of q, k, v, dout), beside the step's peak; the whole inputs,
    # which every rank holds here for the reference, are left out
    result["shard_gib_per_gpu"] = sum(t.numel() * t.element_size() for t in (*leaves, local_dout)) / 2**30
    result["total_gib_per_gpu"] = torch.cuda.mem_get_info()[1] / 2**30
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
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    result["errors"] = {name: [max(e[name][i] for e in gathered) for i in (0, 1)] for name in errors}
    return result


def _worker(rank: int, world: int, store_path: str, result_path: str, repeats: int) -> None:
    """One rank of the suite, on GPU `rank`; rank 0 writes the results to result_path (JSON)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    try:
        ring = import_ring_flash_attn()
        groups = {size: dist.new_group(list(range(size))) for size in world_sizes(world)}  # every rank creates each
        result = {"world": world, **_scaling_rows(ring, rank, groups, repeats)}
        result["long"] = _long_sequence(ring, rank, world)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run(repeats: int) -> dict:
    """The suite's results: {"world", "weak", "strong", "long"}, from one process a GPU, on the largest power of two
    of the visible GPUs up to MAX_WORLD (the sequences' lengths divide by twice it)."""
    import torch

    world = 1 << (min(torch.cuda.device_count(), MAX_WORLD).bit_length() - 1)  # a power of two: the shards divide
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        args = (world, os.path.join(folder, "store"), path, repeats)
        torch.multiprocessing.spawn(_worker, args=args, nprocs=world)
        with open(path) as f:
            return json.load(f)


def _scaling_table(rows: list[dict], sizes: list[int], weak: bool) -> list[list[str]]:
    head = ["function", "mask", "tokens per GPU" if weak else "tokens"]
    head += [f"{w} GPU{'s' if w > 1 else ''} ms" + ("" if w == 1 else " (eff.)") for w in sizes]
    table = [head]
    for r in rows:
        one = r["ms"]["1"]
        cells = [r["function"], "causal" if r["causal"] else "full", str(r["tokens"]), f"{one:.2f}"]
        for w in sizes[1:]:
            t = r["ms"][str(w)]
            efficiency = w * one / t if weak else one / (w * t)
            cells.append(f"{t:.2f} ({efficiency:.2f})")
        table.append(cells)
    return table


def tables(result: dict) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of the suite's tables: weak scaling, strong scaling, the long sequence."""
    sizes = world_sizes(result["world"])
    shape = f"bf16, {STEP_HEADS} heads of {STEP_HEAD_DIM}, one step (forward + backward)"
    weak_title = (
        f"Weak scaling, {shape}: the same tokens per GPU on 1 to {sizes[-1]} GPUs (efficiency: W x the 1-GPU time / "
        "the W-GPU time; each GPU attends to W times the keys)"
    )
    strong_title = f"Strong scaling, {shape}: one sequence over 1 to {sizes[-1]} GPUs (efficiency: t_1 / (W t_W))"
    long = result["long"]
    long_rows = [["output", "max error", "peer's", "peer", "2x rule"]]
    for name, (err, peer_err) in long["errors"].items():
        peer = "PyTorch bf16" if name in ("out", "lse", "dq") else "flash_attn_func, 1 GPU"
        ok = err <= 2 * peer_err + 1e-5
        long_rows.append([name, f"{err:.3e}", f"{peer_err:.3e}", peer, "ok" if ok else "FAILED"])
    per_sequence = long["peak_gib_per_gpu"] + long["shard_gib_per_gpu"]  # GiB per GPU for long["tokens"] tokens
    longest = long["tokens"] * long["total_gib_per_gpu"] / per_sequence
    long_title = (
        f"{long['tokens']} tokens, causal, bf16, {long['heads']} heads of {long['head_dim']}, zigzag over "
        f"{long['world']} GPUs: {long['ms']:.1f} ms a step, {long['peak_gib_per_gpu']:.2f} GiB peak per GPU beside its "
        f"{long['shard_gib_per_gpu']:.2f} GiB shard (the GPUs' memory would hold about {longest / 1e6:.1f}M tokens, "
        "extrapolated linearly); SDPA math on 1 GPU: "
        f"{long['math_backend_one_gpu']}"
    )
    return [
        (weak_title, _scaling_table(result["weak"], sizes, True)),
        (strong_title, _scaling_table(result["strong"], sizes, False)),
        (long_title, long_rows),
    ]


def passed(result: dict) -> bool:
    """Whether each output of the long sequence is within the 2x rule of its peer."""
    return all(err <= 2 * peer + 1e-5 for err, peer in result["long"]["errors"].values())
