"""python -m cuteflash.bench: does cuteflash work on this GPU, is it correct, and how much memory and
time does it save over what PyTorch offers?

Each case is checked against a float64 reference (forward and backward: error at most 2x PyTorch's own
in the input dtype), its peak memory is compared with plain PyTorch attention (softmax(QK^T)V, SDPA's
math backend), and it is timed beside PyTorch's SDPA backends (flash, cuDNN, memory-efficient, math) in
the same run. TFLOP/s follow FlashAttention's count: 4 * batch * heads * seqlen_q * seqlen_k * headdim
for the forward pass, halved when causal, and 2.5 times that for the backward pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial

from . import _families

# (batch, heads, seqlen, headdim)
SUITES = {
    # small, medium, large, and very large head dims
    "default": [
        (1, 1, 16, 16),
        (1, 1, 128, 64),
        (1, 1, 256, 256),
        (1, 16, 1024, 64),
        (1, 32, 1024, 128),
        (1, 32, 2048, 128),
        (1, 32, 4096, 128),
        (1, 16, 1024, 256),
        (1, 32, 4096, 256),
    ],
    # shapes that fill a large GPU (16k tokens or more per call): the kernels decide the speed, not the host
    "baselines": [(16, 16, 1024, 64), (8, 16, 2048, 64), (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 32, 4096, 256)],
    "varlen": [],  # VARLEN_MIXED and VARLEN_EQUAL only
    "options": [],  # OPTIONS_SHAPE only
    "decode": [],  # DECODE_SHAPES only
    "latency": [],  # LATENCY_SHAPES only
    "ring": [],  # bench_ring.py: context parallelism over two GPUs (ring-flash-attn)
    "ops": [],  # bench_ops.py: the fused norms and cross-entropy beside the PyTorch composition
}
QUICK_SHAPES = [(1, 4, 256, 64), (1, 16, 1024, 128)]
# Variable-length batches (flash_attn_varlen_func), causal. "mixed": lengths drawn uniformly from 128-4096 up
# to 65536 tokens, 16 heads of 128, timed beside SDPA's backends on the batch padded to its longest sequence
# (what runs without varlen). "equal": equal lengths through varlen beside flash_attn_func on the same batch.
# The default suite runs the mixed batch; --suite varlen all of them.
VARLEN_MIXED = (65536, 128, 4096, 16, 128)  # tokens, shortest, longest, heads, head dim
VARLEN_EQUAL = [(8, 16, 2048, 64), (2, 16, 8192, 128)]  # (batch, heads, seqlen, headdim)
# The options (flash_attn_func's window_size, softcap, alibi_slopes, dropout_p) on one causal shape, each beside
# the same call without it: a sliding window skips the key blocks outside it, the others change every score.
OPTIONS_SHAPE = (1, 16, 16384, 128)  # (batch, heads, seqlen, headdim)
OPTIONS = {
    "window (1024, 0)": {"window_size": (1024, 0)},
    "softcap 30": {"softcap": 30.0},
    "alibi": {},
    "dropout 0.1": {"dropout_p": 0.1},
    "softcap 30, dropout 0.1": {"softcap": 30.0, "dropout_p": 0.1},
}
# Decoding (flash_attn_with_kvcache, 32 heads of 128, fp16): (batch, cached keys, queries per sequence), timed
# beside SDPA's backends on the same keys, and as paged caches (pages of 16 and 256 rows); the cache read is also
# given as a fraction of the GPU's copy bandwidth (a device-to-device copy, measured in the same run). Of the rows
# with more queries (speculative decoding, chunked prefill; every query sees every key), those of 16 run the
# decoding kernel, those of 512 the tiled kernels.
DECODE_SHAPES = [(1, 8192, 1), (1, 65536, 1), (8, 8192, 1), (32, 8192, 1), (1, 8192, 16), (8, 8192, 16), (1, 8192, 512)]
DECODE_HEADS, DECODE_HEAD_DIM, DECODE_PAGES = 32, 128, (16, 256)
# Per-call latency: the wall time of one call in a loop of back-to-back calls, host and GPU together (the timer
# synchronises at each end of a block of calls), causal fp16, (batch, seqlen, heads, head_dim) and whether the call
# includes the backward pass (torch.autograd.grad). Where the host's work per call exceeds the GPU's, this is what a
# training or decoding loop pays. Run with the default and quick suites, and alone with --suite latency.
LATENCY_SHAPES = [
    ((1, 512, 16, 64), True),
    ((4, 1024, 16, 128), True),
    ((1, 1, 32, 128), False),
    ((8, 128, 16, 64), False),
]
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")  # math: plain PyTorch attention
FAST_SDPA = SDPA_BACKENDS[:3]
IMPLS = ("cuteflash",) + SDPA_BACKENDS
DIRECTIONS = ("fwd", "bwd")


@dataclass
class Case:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str

    def flops(self, direction: str) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        f = f / 2 if self.causal else f
        return f * 2.5 if direction == "bwd" else f  # the backward pass does 2.5x the forward's matmuls


@dataclass
class Result:
    case: Case
    correct: bool | None = None  # forward and (unless --forward-only) backward within the 2x rule
    max_err: dict = field(default_factory=dict)  # out/dq/dk/dv -> cuteflash's max error vs float64
    pytorch_err: dict = field(default_factory=dict)  # the same for PyTorch in the input dtype
    peak_mib: dict = field(default_factory=dict)  # cuteflash / math -> peak extra MiB of fwd(+bwd)
    ms: dict = field(default_factory=dict)  # fwd/bwd -> implementation -> milliseconds (None: did not run)
    tflops: dict = field(default_factory=dict)  # the same, in TFLOP/s
    note: str = ""

    def speedup(self, direction: str, over: str) -> float | None:
        """How many times faster cuteflash is than `over` ('math', or 'best' of the fast SDPA backends);
        direction 'total' is forward plus backward."""

        def ms(impl, d):
            return self.ms.get(d, {}).get(impl)

        dirs = DIRECTIONS if direction == "total" else (direction,)
        ours = [ms("cuteflash", d) for d in dirs]
        if None in ours:
            return None
        if over == "best":
            totals = [sum(ms(b, d) for d in dirs) for b in FAST_SDPA if all(ms(b, d) for d in dirs)]
            theirs = min(totals) if totals else None
        else:
            theirs = sum(ms(over, d) for d in dirs) if all(ms(over, d) for d in dirs) else None
        return theirs / sum(ours) if theirs else None

    def best_backend(self) -> str | None:
        fwd = {b: t for b, t in self.ms.get("fwd", {}).items() if b in FAST_SDPA and t}
        return min(fwd, key=fwd.get) if fwd else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cuteflash.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--suite", choices=list(SUITES), default="default", help="the shapes to run (default: %(default)s)")
    p.add_argument(
        "--dtype",
        choices=["fp16", "bf16"],
        action="append",
        help="repeatable; default fp16 (and bf16 where the GPU has it)",
    )
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only causal (--causal) or only full (--no-causal) attention; default both",
    )
    p.add_argument("--headdim", type=int, action="append", help="repeatable; default: the suite's")
    p.add_argument("--seqlen", type=int, action="append", help="repeatable; default: the suite's")
    p.add_argument("--batch", type=int, help="default: the suite's")
    p.add_argument("--heads", type=int, help="default: the suite's")
    p.add_argument("--forward-only", action="store_true", help="check and time the forward pass only")
    p.add_argument(
        "--deterministic", action="store_true", help="cuteflash's deterministic backward pass (dQ without atomics)"
    )
    p.add_argument("--backend", choices=["auto", *_families.NAMES], default="auto", help="cuteflash kernel family")
    p.add_argument(
        "--layout",
        choices=["native", "bshd", "bhsd"],
        default="native",
        help="memory of the inputs: native (cuteflash reads contiguous (b, s, h, d) as flash-attn, "
        "SDPA contiguous (b, h, s, d)), or the same memory for all: bshd or bhsd",
    )
    p.add_argument("--repeats", type=int, default=30, help="timed batches per measurement (median reported)")
    p.add_argument("--quick", action="store_true", help="two small shapes, fp16: a smoke test")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument(
        "--peers",
        default=",".join(SDPA_BACKENDS),
        help="comma-separated SDPA backends to time beside cuteflash (default: %(default)s; math is also the "
        "memory comparison)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write the results as CSV")
    p.add_argument("--plot", metavar="PATH", help="PNG of TFLOP/s against seqlen per implementation (matplotlib)")
    args = p.parse_args(argv)
    args.peers = [name for name in args.peers.split(",") if name]
    unknown = sorted(set(args.peers) - set(SDPA_BACKENDS))
    if unknown:
        p.error(f"--peers: unknown backend(s) {', '.join(unknown)}; choose from {', '.join(SDPA_BACKENDS)}")
    return args


def kernel_head_dim(head_dim: int, compiled) -> int | None:
    """The kernel head dim that serves head_dim (the next one after padding to 8), if it is compiled."""
    from ._lib import kernel_head_dim as serving_head_dim

    serving = serving_head_dim(head_dim)
    return serving if serving in compiled else None


def build_cases(args, bf16_ok: bool, head_dims_ok=None) -> list[Case]:
    """The cases to run; head_dims_ok (kernel head dims compiled in) drops shapes the build cannot serve."""
    dtypes = args.dtype or (["fp16"] if args.quick or not bf16_ok else ["fp16", "bf16"])
    causals = [args.causal] if args.causal is not None else [False, True]
    shapes = QUICK_SHAPES if args.quick else SUITES[args.suite]
    if args.headdim or args.seqlen or args.batch or args.heads:
        head_dims = args.headdim or sorted({s[3] for s in shapes})
        seqlens = args.seqlen or sorted({s[2] for s in shapes})
        shapes = [
            (args.batch or max(1, 16384 // s), args.heads or (32 if d >= 256 else 16), s, d)
            for s in seqlens
            for d in head_dims
        ]
    if head_dims_ok is not None:
        shapes = [s for s in shapes if kernel_head_dim(s[3], head_dims_ok)]
    return [Case(b, h, s, s, d, c, dt) for dt in dtypes for (b, h, s, d) in shapes for c in causals]


def _time_ms(fns, repeats: int) -> float:
    """Median milliseconds per call. fns are the same call on different input sets, used in turn so
    that small cases are not timed out of the L2 cache. Each timed batch runs back-to-back calls
    (about 2 ms of GPU work, at least two calls) queued behind a short GPU sleep, so that the host has
    launched ahead when the clock starts: its launch cost is hidden wherever the GPU is the bottleneck,
    as in a training loop, and counted where the host is. (Without the sleep, a batch of one long call
    also timed the host's time to launch it: at B=8, H=16, S=2048, D=64 that took 25 % off cuteflash's
    backward and 15 % off PyTorch's flash backend on the H200.) Not torch.utils.benchmark's Timer or triton's
    do_bench: they time calls as the host issues them, so a short call counts the host's launch cost; that is what
    the latency table wants (_latency_us uses the Timer), not the TFLOP/s tables."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in fns:
        fn()
    end.record()
    end.synchronize()
    per_call = start.elapsed_time(end) / len(fns)
    inner = max(2, min(200, int(2.0 / max(per_call, 1e-3))))
    sleep = getattr(torch.cuda, "_sleep", None)
    times = []
    for _ in range(repeats):
        if sleep is not None:
            sleep(2_000_000)  # about 1 ms of GPU clock cycles
        start.record()
        for i in range(inner):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    return times[len(times) // 2]


def _backward_call(fwd, qkv):
    """A call that runs only the backward pass of fwd on these inputs (the graph is built once)."""
    import torch

    leaves = [t.detach().requires_grad_() for t in qkv]
    out = fwd(*leaves)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _implementations(case: Case, args):
    """name -> (context factory, forward function taking that implementation's (q, k, v) layout)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import flash_attn_func

    def cuteflash_fwd(q, k, v):
        return flash_attn_func(q, k, v, causal=case.causal, deterministic=args.deterministic)

    def sdpa_fwd(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    impls = {"cuteflash": (contextlib.nullcontext, cuteflash_fwd)}
    impls.update({name: (lambda b=b: sdpa_kernel(b), sdpa_fwd) for name, b in backends.items() if name in args.peers})
    return impls


def _check(case: Case, q, k, v, args, res: Result) -> None:
    """The 2x rule on a slice of the heads (the float64 reference holds the whole score matrix)."""
    import torch

    from . import flash_attn_func
    from .reference import attention_ref

    dtype = q.dtype
    heads = slice(0, min(2, case.heads))
    qs, ks, vs = (t[:1, :, heads].detach() for t in (q, k, v))
    dout = torch.randn_like(qs)
    outputs = {}
    for name, compute in (("ref", torch.float64), ("pytorch", dtype)):
        leaves = [t.to(compute).requires_grad_(not args.forward_only) for t in (qs, ks, vs)]
        out, _ = attention_ref(*leaves, causal=case.causal, compute_dtype=compute)
        grads = [] if args.forward_only else torch.autograd.grad(out, leaves, dout.to(compute))
        outputs[name] = [out.detach(), *grads]
        del out, leaves
    leaves = [t.clone().requires_grad_(not args.forward_only) for t in (qs, ks, vs)]
    out = flash_attn_func(*leaves, causal=case.causal, deterministic=args.deterministic)
    grads = [] if args.forward_only else torch.autograd.grad(out, leaves, dout)
    ok = True
    for name, mine, ref, pt in zip(
        ("out", "dq", "dk", "dv"), [out.detach(), *grads], outputs["ref"], outputs["pytorch"]
    ):
        res.max_err[name] = (mine.double() - ref).abs().max().item()
        res.pytorch_err[name] = (pt.double() - ref).abs().max().item()
        ok = ok and res.max_err[name] <= 2 * res.pytorch_err[name] + 1e-5
    res.correct = bool(ok)


def _peak_mib(fwd, qkv, backward: bool) -> float:
    """Peak memory beyond the inputs of one forward (and backward) pass, in MiB, after a first pass (which may keep
    what every later call shares, such as cuteflash's log-sum-exp scratch of calls without a gradient)."""
    import torch

    def one_pass():
        leaves = [t.detach().requires_grad_(backward) for t in qkv]
        out = fwd(*leaves)
        if backward:
            torch.autograd.grad(out, leaves, torch.ones_like(out))

    one_pass()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    one_pass()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(case: Case, args) -> Result:
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    res = Result(case)
    shape_q = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    shape_k = (case.batch, case.seqlen_k, case.heads, case.head_dim)
    bytes_per_set = 2 * (2 * math.prod(shape_q) + 2 * math.prod(shape_k))
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    n_sets = max(1, min(8, math.ceil(3 * l2 / bytes_per_set)))
    sets = [
        tuple(torch.randn(s, device="cuda", dtype=dtype) for s in (shape_q, shape_k, shape_k)) for _ in range(n_sets)
    ]
    # cuteflash takes (b, s, h, d) views and SDPA (b, h, s, d) views; `layout` says which memory is
    # contiguous under them (native: each its own).
    sets_t = [tuple(t.transpose(1, 2) for t in qkv) for qkv in sets]
    if args.layout in ("native", "bhsd"):
        sets_t = [tuple(t.contiguous() for t in qkv) for qkv in sets_t]
    if args.layout == "bhsd":
        sets = [tuple(t.transpose(1, 2) for t in qkv) for qkv in sets_t]

    if not args.no_check:
        try:
            _check(case, *sets[0], args, res)
        except torch.cuda.OutOfMemoryError:
            res.note = "reference out of memory: not checked"
        torch.cuda.empty_cache()

    impls = _implementations(case, args)
    backward = not args.forward_only
    for name in ("cuteflash", "math") if "math" in impls else ():
        context, fwd = impls[name]
        try:
            with context():
                res.peak_mib[name] = _peak_mib(fwd, (sets if name == "cuteflash" else sets_t)[0], backward)
        except torch.cuda.OutOfMemoryError:
            res.peak_mib[name] = None
            res.note = (res.note + "; " if res.note else "") + f"{name} out of memory"
        torch.cuda.empty_cache()

    for direction in DIRECTIONS[:1] if args.forward_only else DIRECTIONS:
        res.ms[direction], res.tflops[direction] = {}, {}
        for name, (context, fwd) in impls.items():
            inputs = sets if name == "cuteflash" else sets_t
            fns = []
            try:
                with context():
                    fns = [
                        (lambda qkv=qkv, fwd=fwd: fwd(*qkv)) if direction == "fwd" else _backward_call(fwd, qkv)
                        for qkv in inputs
                    ]
                    ms = _time_ms(fns, args.repeats)
                res.ms[direction][name] = ms
                res.tflops[direction][name] = case.flops(direction) / (ms * 1e-3) / 1e12
            except (RuntimeError, NotImplementedError, torch.cuda.OutOfMemoryError):
                if name == "cuteflash":
                    raise
                res.ms[direction][name] = res.tflops[direction][name] = None  # this backend does not run it
            del fns
            torch.cuda.empty_cache()
    return res


@dataclass
class VarlenResult:
    name: str  # "mixed ..." or "equal ..."
    dtype: str
    ms: dict = field(default_factory=dict)  # fwd/bwd -> implementation -> milliseconds (None: did not run)
    peers: tuple = ()  # the implementations cuteflash's varlen call is compared with


def _varlen_lengths(tokens: int, shortest: int, longest: int) -> list[int]:
    """Lengths drawn uniformly from [shortest, longest] (a fixed seed) until they sum to `tokens`."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(shortest, longest + 1, (), generator=g)), tokens - sum(lengths)))
    return lengths


def _time_directions(res, name: str, fwd, inputs, args) -> None:
    """Times fwd (and its backward) on each input set under name, into res.ms (res: a VarlenResult, or the
    dict itself); None where it does not run."""
    import torch

    ms = res if isinstance(res, dict) else res.ms
    for direction in DIRECTIONS[:1] if args.forward_only else DIRECTIONS:
        try:
            fns = [(lambda x=x: fwd(*x)) if direction == "fwd" else _backward_call(fwd, x) for x in inputs]
            ms.setdefault(direction, {})[name] = _time_ms(fns, args.repeats)
        except (RuntimeError, NotImplementedError, torch.cuda.OutOfMemoryError):
            if name.startswith("cuteflash"):
                raise
            ms.setdefault(direction, {})[name] = None
        torch.cuda.empty_cache()


def run_varlen(args, dtype_name: str, equal: bool) -> list[VarlenResult]:
    """The mixed batch against SDPA on the padded batch; with `equal`, also the equal-length batches against
    flash_attn_func."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import flash_attn_func, flash_attn_varlen_func

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    results = []
    tokens, shortest, longest, heads, head_dim = VARLEN_MIXED
    lengths = _varlen_lengths(tokens, shortest, longest)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    qkv = [torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3)]
    res = VarlenResult(
        f"mixed {len(lengths)} seqs {shortest}-{max(lengths)}, {tokens} tokens, {heads}x{head_dim}", dtype_name
    )

    def varlen_fwd(q, k, v, cu=cu, longest=longest):
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    _time_directions(res, "cuteflash varlen", varlen_fwd, [qkv], args)
    del qkv
    padded = [torch.randn(len(lengths), heads, longest, head_dim, device="cuda", dtype=dtype) for _ in range(3)]
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, backend in backends.items():
        if name in args.peers:
            with sdpa_kernel(backend):
                _time_directions(
                    res,
                    f"{name} padded",
                    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    [padded],
                    args,
                )
    del padded
    res.peers = tuple(n for n in res.ms["fwd"] if n != "cuteflash varlen")
    results.append(res)
    for batch, heads, seqlen, head_dim in VARLEN_EQUAL if equal else ():
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
        qkv = [torch.randn(batch * seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3)]
        res = VarlenResult(f"equal {batch}x{heads}x{seqlen}x{head_dim}", dtype_name, peers=("cuteflash",))

        def equal_varlen(q, k, v, cu=cu, seqlen=seqlen):
            return flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True)

        def fixed(q, k, v, batch=batch):
            return flash_attn_func(*(t.view(batch, -1, *t.shape[1:]) for t in (q, k, v)), causal=True)

        _time_directions(res, "cuteflash varlen", equal_varlen, [qkv], args)
        _time_directions(res, "cuteflash", fixed, [qkv], args)
        results.append(res)
        del qkv
    return results


def run_options(args, dtype_name: str) -> list[VarlenResult]:
    """Each of OPTIONS on OPTIONS_SHAPE, causal, beside flash_attn_func without it."""
    import torch

    from . import flash_attn_func

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    batch, heads, seqlen, head_dim = OPTIONS_SHAPE
    qkv = [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3)]
    slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")
    plain = {}
    _time_directions(plain, "cuteflash plain", lambda q, k, v: flash_attn_func(q, k, v, causal=True), [qkv], args)
    results = []
    for name, options in OPTIONS.items():
        options = dict(options, alibi_slopes=slopes) if name == "alibi" else options
        res = VarlenResult(f"{name}, {batch}x{heads}x{seqlen}x{head_dim}", dtype_name, peers=("cuteflash plain",))

        def with_option(q, k, v, options=options):
            return flash_attn_func(q, k, v, causal=True, **options)

        _time_directions(res, "cuteflash option", with_option, [qkv], args)
        for direction, times in plain.items():
            res.ms[direction].update(times)
        results.append(res)
    return results


def _copy_bandwidth(args) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write)."""
    import torch

    src = torch.empty(2**29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms([lambda: dst.copy_(src)], args.repeats)
    return 2 * src.numel() * 2 / ms / 1e6


def run_decode(args) -> list[list[str]]:
    """DECODE_SHAPES: rows of a table of microseconds per call, cuteflash's and SDPA's, and bandwidths."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import flash_attn_with_kvcache

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    backends["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    copy_gbs = _copy_bandwidth(args)
    rows = [
        ["batch x queries x keys", "cuteflash us", *(f"{b} us" for b in backends), "x best SDPA"]
        + ["cache GB/s", "of copy", *(f"paged {p} us" for p in DECODE_PAGES)]
    ]
    heads, d = DECODE_HEADS, DECODE_HEAD_DIM
    for batch, keys, queries in DECODE_SHAPES:
        dev = dict(device="cuda", dtype=torch.float16)
        q = torch.randn(batch, queries, heads, d, **dev)
        k_cache, v_cache = (torch.randn(batch, keys, heads, d, **dev) for _ in range(2))
        seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        ours = _time_ms([partial(flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens)], args.repeats)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k_cache, v_cache))
        del k_cache, v_cache
        sdpa = {}
        for name, backend in backends.items():
            if name not in args.peers:
                continue
            try:
                with sdpa_kernel(backend):
                    sdpa[name] = _time_ms([partial(F.scaled_dot_product_attention, qt, kt, vt)], args.repeats)
            except RuntimeError:
                sdpa[name] = None
        del kt, vt
        paged = []
        for page in DECODE_PAGES:
            pages = batch * keys // page
            kp, vp = (torch.randn(pages, page, heads, d, **dev) for _ in range(2))
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
            call = partial(flash_attn_with_kvcache, q, kp, vp, cache_seqlens=seqlens, block_table=table)
            paged.append(_time_ms([call], args.repeats))
            del kp, vp
        best = min((t for t in sdpa.values() if t), default=None)
        gbs = 2 * batch * keys * heads * d * 2 / ours / 1e6
        rows.append(
            [f"{batch} x {queries} x {keys}", f"{ours * 1e3:.1f}"]
            + [f"{sdpa[n] * 1e3:.1f}" if sdpa.get(n) else "-" for n in backends]
            + [f"{best / ours:.2f}x" if best else "-", f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}"]
            + [f"{t * 1e3:.1f}" for t in paged]
        )
    print(f"\ncopy bandwidth: {copy_gbs:.0f} GB/s (device-to-device, read + write)")
    return rows


def _latency_us(fn) -> float:
    """Median microseconds per call of fn in back-to-back calls, host included (torch.utils.benchmark)."""
    from torch.utils.benchmark import Timer

    fn()
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median * 1e6


def _graphed(fn, inputs: list, backward: bool):
    """fn(*inputs) captured in a CUDA graph, as a function that replays it when called like fn (with backward:
    torch.cuda.make_graphed_callables, which copies its arguments in and whose backward replays a graph of its own;
    without: a replay of the captured call, its arguments ignored)."""
    import torch

    if backward:
        # Its warm-up and its capture of the backward pass run on two side streams; autograd warns that the
        # inputs' gradient nodes see both (torch's own doing, harmless here).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            return torch.cuda.make_graphed_callables(fn, tuple(inputs))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up calls outside the capture, as torch.cuda.graph asks
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    return lambda *args: graph.replay()


def run_latency(args) -> list[list[str]]:
    """LATENCY_SHAPES: rows of a table of microseconds per call, cuteflash's and the fast SDPA backends', eager and
    (cuteflash and the flash backend) captured in a CUDA graph, where the host's work per call is gone."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import flash_attn_func

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    backends["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    backends = {name: b for name, b in backends.items() if name in args.peers}
    graphed_peer = "flash" if "flash" in backends else None
    rows = [["batch, seqlen, heads, dim", "pass", "cuteflash us", *(f"{b} us" for b in backends), "x best SDPA"]]
    rows[0] += ["cuteflash graphed us"] + ([f"{graphed_peer} graphed us", "x graphed"] if graphed_peer else [])

    def timed(fwd, qkv, dout, graph=False):
        if graph:
            fwd = _graphed(fwd, qkv, dout is not None)

        def call():
            out = fwd(*qkv)
            if dout is not None:
                torch.autograd.grad(out, qkv, dout)

        return _latency_us(call)

    def sdpa_with(backend):
        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return sdpa

    for shape, backward in LATENCY_SHAPES:
        if kernel_head_dim(shape[3], args.head_dims) is None or (
            backward and kernel_head_dim(shape[3], args.backward_head_dims) is None
        ):
            continue
        qkv = [torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=backward) for _ in range(3)]
        dout = torch.randn_like(qkv[0]) if backward else None
        ours_fn = partial(flash_attn_func, causal=True)
        ours = timed(ours_fn, qkv, dout)
        qkv_t = [t.detach().transpose(1, 2).contiguous().requires_grad_(backward) for t in qkv]
        dout_t = None if dout is None else dout.transpose(1, 2).contiguous()
        sdpa = {}
        for name, backend in backends.items():
            try:
                # A backend that refuses the shape warns, then raises: its column shows "-".
                with sdpa_kernel(backend), warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    sdpa[name] = timed(partial(F.scaled_dot_product_attention, is_causal=True), qkv_t, dout_t)
            except RuntimeError:
                sdpa[name] = None
        best = min((t for t in sdpa.values() if t), default=None)
        row = [", ".join(map(str, shape)), "fwd+bwd" if backward else "fwd", f"{ours:.0f}"]
        row += [f"{sdpa[n]:.0f}" if sdpa[n] else "-" for n in backends] + [f"{best / ours:.2f}x" if best else "-"]
        ours_graphed = timed(ours_fn, qkv, dout, graph=True)
        row.append(f"{ours_graphed:.0f}")
        if graphed_peer:
            try:
                theirs = timed(sdpa_with(backends[graphed_peer]), qkv_t, dout_t, graph=True)
            except RuntimeError:
                theirs = None
            row += [f"{theirs:.0f}", f"{theirs / ours_graphed:.2f}x"] if theirs else ["-", "-"]
        rows.append(row)
    return rows


def varlen_table(results: list[VarlenResult], ours_key: str = "cuteflash varlen") -> list[list[str]]:
    rows = [["case", "dtype", "dir", f"{ours_key.split()[-1]} ms", "peer", "peer ms", "speedup"]]
    for r in results:
        for d, times in r.ms.items():
            ours = times.get(ours_key)
            for peer in r.peers:
                theirs = times.get(peer)
                ratio = f"{theirs / ours:.2f}x" if ours and theirs else "-"
                rows.append([r.name, r.dtype, d, f"{ours:.3f}", peer, f"{theirs:.3f}" if theirs else "-", ratio])
    return rows


def _shape(c: Case) -> str:
    return f"{c.dtype} {c.batch}x{c.heads}x{c.seqlen_q}x{c.head_dim}{' causal' if c.causal else ''}"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def tflops_table(results: list[Result]) -> list[list[str]]:
    """Rows of TFLOP/s per implementation and direction (the first row is the header)."""
    rows = [["case", "pass"] + list(IMPLS)]
    for r in results:
        for d in DIRECTIONS:
            t = r.tflops.get(d)
            if t:
                rows.append([_shape(r.case), d] + [f"{t[n]:.1f}" if t.get(n) else "-" for n in IMPLS])
    return rows


def summary_table(results: list[Result]) -> list[list[str]]:
    rows = [["case", "check", "mem /", "fwd xPT", "fwd xSDPA", "bwd xPT", "bwd xSDPA", "total xSDPA", "best SDPA"]]
    for r in results:
        mem = r.peak_mib
        saving = f"{mem['math'] / mem['cuteflash']:.1f}" if mem.get("math") and mem.get("cuteflash") else "-"
        check = {True: "ok", False: "FAIL", None: "-"}[r.correct]
        rows.append(
            [
                _shape(r.case),
                check,
                saving,
                _x(r.speedup("fwd", "math")),
                _x(r.speedup("fwd", "best")),
                _x(r.speedup("bwd", "math")),
                _x(r.speedup("bwd", "best")),
                _x(r.speedup("total", "best")),
                r.best_backend() or "-",
            ]
        )
    return rows


def format_rows(title: str, rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] + ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(2, "-" * len(lines[1]))
    return "\n".join(lines)


def print_tables(results: list[Result]) -> None:
    tables = [
        ("TFLOP/s (math: plain PyTorch attention)", tflops_table(results)),
        (
            "cuteflash against PyTorch. mem /: plain PyTorch's peak memory over cuteflash's; xPT: times "
            "faster than plain PyTorch; xSDPA: than the fastest SDPA backend",
            summary_table(results),
        ),
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is None or not sys.stdout.isatty():  # plain text for logs and pipes
        for title, rows in tables:
            print("\n" + format_rows(title, rows))
        return
    console = Console()
    for title, rows in tables:
        table = Table(title=title)
        for name in rows[0]:
            table.add_column(name, justify="right", no_wrap=True)
        for row in rows[1:]:
            table.add_row(*row)
        console.print(table)


def verdict(results: list[Result]) -> str:
    failed = sum(r.correct is False for r in results)
    parts = ["CORRECT" if not failed else f"{failed} INCORRECT"]
    for d in DIRECTIONS:
        ratios = [r.tflops[d]["cuteflash"] / r.tflops[d]["flash"] for r in results if r.tflops.get(d, {}).get("flash")]
        if ratios:
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            parts.append(f"{'forward' if d == 'fwd' else 'backward'} {geo:.2f}x PyTorch's flash backend")
    savings = [
        r.peak_mib["math"] / r.peak_mib["cuteflash"]
        for r in results
        if r.peak_mib.get("math") and r.peak_mib.get("cuteflash")
    ]
    if savings:
        parts.append(f"up to {max(savings):.0f}x less memory than plain PyTorch")
    return "verdict: " + "; ".join(parts) + " (geometric means)"


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = [d for d in DIRECTIONS if any(r.tflops.get(d) for r in results)]
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.5), squeeze=False)
    for ax, d in zip(axes[0], directions):
        for impl in IMPLS:
            points = sorted((r.case.seqlen_q, r.tflops[d][impl]) for r in results if r.tflops.get(d, {}).get(impl))
            if points:
                ax.plot(*zip(*points), "o", label=impl, alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("forward" if d == "fwd" else "backward")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_outputs(
    results: list[Result], args, device: dict, varlen: list[VarlenResult] = (), options: list[VarlenResult] = ()
) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "results": [asdict(r) for r in results],
                    "varlen": [asdict(r) for r in varlen],
                    "options": [asdict(r) for r in options],
                },
                f,
                indent=1,
            )
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(
                [
                    "dtype",
                    "batch",
                    "heads",
                    "seqlen_q",
                    "seqlen_k",
                    "head_dim",
                    "causal",
                    "correct",
                    "cuteflash_peak_mib",
                    "math_peak_mib",
                ]
                + [f"{n}_{d}_tflops" for d in DIRECTIONS for n in IMPLS]
            )
            for r in results:
                c = r.case
                w.writerow(
                    [
                        c.dtype,
                        c.batch,
                        c.heads,
                        c.seqlen_q,
                        c.seqlen_k,
                        c.head_dim,
                        c.causal,
                        r.correct,
                        r.peak_mib.get("cuteflash"),
                        r.peak_mib.get("math"),
                    ]
                    + [r.tflops.get(d, {}).get(n) for d in DIRECTIONS for n in IMPLS]
                )


def _progress(items, total: int):
    try:
        from rich.progress import track
    except ImportError:
        track = None
    if track is not None and sys.stderr.isatty():
        yield from track(items, total=total, description="benchmarking", transient=True)
        return
    for i, item in enumerate(items):
        c = item
        print(f"[{i + 1}/{total}] {_shape(c)}", file=sys.stderr, flush=True)
        yield item


def _ring_suite(args) -> int:
    """--suite ring: bench_ring.py's tables; 1 where the long sequence fails its checks, 2 where it cannot run."""
    from . import bench_ring

    reason = bench_ring.why_not()
    if reason is not None:
        print(f"cuteflash.bench: the ring suite {reason}", file=sys.stderr)
        return 2
    result = bench_ring.run(min(args.repeats, 10))
    for title, rows in bench_ring.tables(result):
        print("\n" + format_rows(title, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ring": result}, f, indent=1)
    return 0 if bench_ring.passed(result) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("cuteflash.bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    try:
        import torch
    except ImportError:
        print("cuteflash.bench: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("cuteflash.bench: no CUDA GPU is visible; the benchmark needs one", file=sys.stderr)
        return 2
    import os

    if args.suite == "ops":
        from . import bench_ops

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        for title, rows in bench_ops.tables(args, _time_ms):
            print("\n" + format_rows(title, rows))
        return 0
    if args.backend != "auto":
        os.environ["CUTEFLASH_BACKEND"] = args.backend
    from ._lib import build_info, select_family

    try:
        family = select_family(torch.device("cuda"))
    except (RuntimeError, ValueError) as e:
        print(f"cuteflash.bench: {e}", file=sys.stderr)
        return 2
    info = build_info()
    built = info["families"][family]
    cc = torch.cuda.get_device_capability()
    device = {
        "name": torch.cuda.get_device_name(),
        "capability": f"{cc[0]}.{cc[1]}",
        "family": family,
        "torch": torch.__version__,
    }
    print(
        f"{device['name']} (compute capability {device['capability']}), cuteflash {family} kernels, "
        f"torch {torch.__version__}",
        flush=True,
    )
    # The latency table's backward rows: the fp16 backward kernels of any family (a forward-only family's delegate
    # computes its backward), unless --forward-only.
    fp16_bwd = {k["head_dim"] for k in info["kernels"] if k["direction"] == "bwd" and k["dtype"] == "float16"}
    args.backward_head_dims = [] if args.forward_only else sorted(fp16_bwd)
    if "bwd" not in built["directions"]:
        args.forward_only = True
    bf16_ok = "bf16" in _families.get(family).dtypes and "bfloat16" in built["dtypes"]
    if not args.dtype:  # the dtypes compiled in (a developer's build may leave one out); --quick: one of them
        compiled = [n for n, t in (("fp16", "float16"), ("bf16", "bfloat16")) if t in built["dtypes"]]
        args.dtype = [n for n in compiled if n == "fp16" or bf16_ok][: 1 if args.quick else None]
    cases = build_cases(args, bf16_ok=bf16_ok, head_dims_ok=built["head_dims"])
    varlen_runs = not args.quick and args.suite in ("default", "varlen") and VARLEN_MIXED[4] in built["head_dims"]
    options_runs = args.suite == "options" and OPTIONS_SHAPE[3] in built["head_dims"]
    fp16_built = "float16" in built["dtypes"]  # the decoding and latency tables' dtype
    decode_runs = args.suite == "decode" and DECODE_HEAD_DIM in built["head_dims"] and fp16_built
    args.head_dims = built["head_dims"]
    latency_runs = (
        args.suite in ("default", "latency")
        and fp16_built
        and any(kernel_head_dim(shape[3], args.head_dims) for shape, _ in LATENCY_SHAPES)
    )
    if args.suite == "ring":
        return _ring_suite(args)
    if not cases and not varlen_runs and not options_runs and not decode_runs and not latency_runs:
        print("cuteflash.bench: this build serves none of the requested head dims", file=sys.stderr)
        return 2
    results = [run_case(case, args) for case in _progress(cases, len(cases))]
    varlen = []
    if varlen_runs:
        for dtype in args.dtype or ["fp16"]:
            varlen += run_varlen(args, dtype, equal=args.suite == "varlen")
    options = []
    if options_runs:
        for dtype in args.dtype or ["fp16"]:
            options += run_options(args, dtype)
    if decode_runs:
        title = f"Decoding: flash_attn_with_kvcache, {DECODE_HEADS} heads of {DECODE_HEAD_DIM}, fp16, no mask"
        print("\n" + format_rows(title, run_decode(args)))
    if results:
        print_tables(results)
    if latency_runs:
        title = "Per-call latency, causal fp16: microseconds per call in a loop of calls, host and GPU"
        title += " (graphed: the call captured in a CUDA graph)"
        print("\n" + format_rows(title, run_latency(args)))
    if varlen:
        print(
            "\n" + format_rows("Variable-length batches, causal (speedup: peer ms / varlen ms)", varlen_table(varlen))
        )
    if options:
        title = "Options, causal (speedup: ms without the option / ms with it)"
        print("\n" + format_rows(title, varlen_table(options, "cuteflash option")))
    write_outputs(results, args, device, varlen, options)
    if args.plot and results:
        plot(results, args.plot)
    if results:
        print(verdict(results))
    return 1 if any(r.correct is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
