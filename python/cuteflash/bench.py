"""python -m cuteflash.bench: does cuteflash work on this GPU, is it correct, and how fast is it
next to PyTorch's attention backends?

Each case is checked against a float64 reference (error at most 2x PyTorch's own in the input dtype)
and timed beside PyTorch's SDPA backends (flash, cuDNN, memory-efficient) and plain PyTorch attention,
in the same run. TFLOP/s follow FlashAttention's convention: 4 * batch * heads * seqlen_q * seqlen_k *
headdim for the forward pass, halved when causal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field

# The shapes of shared/baselines-h200.md: (batch, heads, seqlen, headdim).
BASELINE_SHAPES = [(16, 16, 1024, 64), (8, 16, 2048, 64), (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 32, 4096, 256)]
QUICK_SHAPES = [(4, 16, 1024, 64), (2, 16, 2048, 128)]
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


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
    correct: bool | None = None
    max_err: float | None = None
    pytorch_err: float | None = None
    ms: dict = field(default_factory=dict)  # "fwd"/"bwd" -> implementation -> milliseconds (None: unavailable)
    tflops: dict = field(default_factory=dict)  # the same, in TFLOP/s
    note: str = ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cuteflash.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["fp16", "bf16"], action="append",
                   help="repeatable; default fp16 (and bf16 where the GPU has it)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="only causal (--causal) or only full (--no-causal) attention; default both")
    p.add_argument("--headdim", type=int, action="append", help="repeatable; default: the suite's")
    p.add_argument("--seqlen", type=int, action="append", help="repeatable; default: the suite's")
    p.add_argument("--batch", type=int, help="default: the suite's")
    p.add_argument("--heads", type=int, help="default: the suite's")
    p.add_argument("--forward-only", action="store_true", help="time the forward pass only")
    p.add_argument("--deterministic", action="store_true",
                   help="cuteflash's deterministic backward pass (dQ without atomics; slower)")
    p.add_argument("--backend", choices=["auto", "sm70", "sm80"], default="auto", help="cuteflash kernel family")
    p.add_argument("--layout", choices=["native", "bshd", "bhsd"], default="native",
                   help="memory of the inputs: native (cuteflash reads contiguous (b, s, h, d) as flash-attn, "
                        "SDPA contiguous (b, h, s, d)), or the same memory for all: bshd or bhsd")
    p.add_argument("--repeats", type=int, default=30, help="timed runs per measurement (median reported)")
    p.add_argument("--quick", action="store_true", help="two small shapes, fp16, for a smoke test")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--csv", metavar="PATH", help="write the results as CSV")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    return p.parse_args(argv)


def build_cases(args, bf16_ok: bool) -> list[Case]:
    dtypes = args.dtype or (["fp16"] if args.quick or not bf16_ok else ["fp16", "bf16"])
    causals = [args.causal] if args.causal is not None else [False, True]
    shapes = QUICK_SHAPES if args.quick else BASELINE_SHAPES
    if args.headdim or args.seqlen or args.batch or args.heads:
        head_dims = args.headdim or sorted({s[3] for s in shapes})
        seqlens = args.seqlen or sorted({s[2] for s in shapes})
        shapes = []
        for s in seqlens:
            for d in head_dims:
                batch = args.batch or max(1, 16384 // s)
                shapes.append((batch, args.heads or (32 if d >= 256 else 16), s, d))
    return [Case(b, h, s, s, d, c, dt) for dt in dtypes for (b, h, s, d) in shapes for c in causals]


def _time_ms(fns, repeats: int) -> float:
    """Median milliseconds per call. fns are the same call on different input sets, used in turn so
    that small cases are not timed out of the L2 cache. Each timed batch runs back-to-back calls
    (about 2 ms of GPU work), so the host's launch cost is hidden wherever the GPU is the bottleneck,
    as in a training loop, and counted where the host is."""
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
    inner = max(1, min(200, int(2.0 / max(per_call, 1e-3))))
    times = []
    for _ in range(repeats):
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


def run_case(case: Case, args) -> Result:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import flash_attn_func
    from .reference import attention_ref

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    res = Result(case)
    shape_q = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    shape_k = (case.batch, case.seqlen_k, case.heads, case.head_dim)
    bytes_per_set = 2 * (2 * math.prod(shape_q) + 2 * math.prod(shape_k))
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    n_sets = max(1, min(8, math.ceil(3 * l2 / bytes_per_set)))
    sets = [tuple(torch.randn(s, device="cuda", dtype=dtype) for s in (shape_q, shape_k, shape_k))
            for _ in range(n_sets)]
    q, k, v = sets[0]

    if not args.no_check:
        # A slice of the heads keeps the float64 reference small.
        hs = slice(0, min(2, case.heads))
        qs, ks, vs = q[:1, :, hs], k[:1, :, hs], v[:1, :, hs]
        try:
            ref, _ = attention_ref(qs, ks, vs, causal=case.causal)
            pt, _ = attention_ref(qs, ks, vs, causal=case.causal, compute_dtype=dtype)
            out = flash_attn_func(qs, ks, vs, causal=case.causal)
            res.max_err = (out.double() - ref).abs().max().item()
            res.pytorch_err = (pt.double() - ref).abs().max().item()
            res.correct = bool(res.max_err <= 2 * res.pytorch_err + 1e-5)
            del ref, pt, out
        except torch.cuda.OutOfMemoryError:
            res.note = "reference out of memory: not checked"
        torch.cuda.empty_cache()

    # cuteflash takes (b, s, h, d) views and SDPA (b, h, s, d) views; `layout` says which memory is
    # contiguous under them (native: each its own).
    sets_t = [tuple(t.transpose(1, 2) for t in qkv) for qkv in sets]
    if args.layout == "native":
        sets_t = [tuple(t.contiguous() for t in qkv) for qkv in sets_t]
    elif args.layout == "bhsd":
        sets_t = [tuple(t.contiguous() for t in qkv) for qkv in sets_t]
        sets = [tuple(t.transpose(1, 2) for t in qkv) for qkv in sets_t]
    def cuteflash_fwd(q, k, v):
        return flash_attn_func(q, k, v, causal=case.causal, deterministic=args.deterministic)

    def sdpa_fwd(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    impls = {"cuteflash": (contextlib.nullcontext, cuteflash_fwd, sets)}
    impls.update({name: (lambda b=b: sdpa_kernel(b), sdpa_fwd, sets_t) for name, b in backends.items()})
    directions = ["fwd"] if args.forward_only else ["fwd", "bwd"]
    for direction in directions:
        res.ms[direction], res.tflops[direction] = {}, {}
        for name, (context, fwd, inputs) in impls.items():
            try:
                with context():
                    fns = [(lambda qkv=qkv: fwd(*qkv)) if direction == "fwd" else _backward_call(fwd, qkv)
                           for qkv in inputs]
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


def format_table(results: list[Result]) -> str:
    impls = ["cuteflash", *SDPA_BACKENDS]
    lines = []
    for direction in ("fwd", "bwd"):
        rows = [r for r in results if r.tflops.get(direction)]
        if not rows:
            continue
        header = (f"{'dtype':5} {'B':>3} {'H':>3} {'S':>6} {'D':>4} {'causal':6} "
                  + " ".join(f"{n:>10}" for n in impls) + f" {'vs flash':>8} {'check':>6}")
        lines += ["", f"{'forward' if direction == 'fwd' else 'backward'} TFLOP/s", header, "-" * len(header)]
        for r in rows:
            c, t = r.case, r.tflops[direction]
            cells = " ".join(f"{t[n]:10.1f}" if t.get(n) else f"{'-':>10}" for n in impls)
            ratio = t["cuteflash"] / t["flash"] if t.get("flash") else float("nan")
            check = {True: "ok", False: "FAIL", None: "-"}[r.correct]
            lines.append(f"{c.dtype:5} {c.batch:3} {c.heads:3} {c.seqlen_q:6} {c.head_dim:4} {str(c.causal):6} "
                         f"{cells} {ratio:8.2f} {check:>6}")
    return "\n".join(lines)


def write_outputs(results: list[Result], args, device: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "results": [asdict(r) for r in results]}, f, indent=1)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            impls = ["cuteflash", *SDPA_BACKENDS]
            w.writerow(["dtype", "batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "causal", "correct", "max_err",
                        "pytorch_err"] + [f"{n}_{d}_tflops" for d in ("fwd", "bwd") for n in impls])
            for r in results:
                c = r.case
                w.writerow([c.dtype, c.batch, c.heads, c.seqlen_q, c.seqlen_k, c.head_dim, c.causal, r.correct,
                            r.max_err, r.pytorch_err]
                           + [r.tflops.get(d, {}).get(n) for d in ("fwd", "bwd") for n in impls])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("cuteflash.bench: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("cuteflash.bench: no CUDA GPU is visible; the benchmark needs one", file=sys.stderr)
        return 2
    import os

    if args.backend != "auto":
        os.environ["CUTEFLASH_BACKEND"] = args.backend
    from ._lib import select_family

    try:
        family = select_family(torch.device("cuda"))
    except (RuntimeError, ValueError) as e:
        print(f"cuteflash.bench: {e}", file=sys.stderr)
        return 2
    cc = torch.cuda.get_device_capability()
    device = {"name": torch.cuda.get_device_name(), "capability": f"{cc[0]}.{cc[1]}", "family": family,
              "torch": torch.__version__}
    print(f"{device['name']} (compute capability {device['capability']}), cuteflash {family} kernels, "
          f"torch {torch.__version__}", flush=True)
    cases = build_cases(args, bf16_ok=family == "sm80")
    results = []
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case.dtype} B={case.batch} H={case.heads} S={case.seqlen_q} "
              f"D={case.head_dim} causal={case.causal}", file=sys.stderr, flush=True)
        results.append(run_case(case, args))
    print(format_table(results))
    write_outputs(results, args, device)
    failed = [r for r in results if r.correct is False]
    speed = []
    for direction in ("fwd", "bwd"):
        ratios = [r.tflops[direction]["cuteflash"] / r.tflops[direction]["flash"]
                  for r in results if r.tflops.get(direction, {}).get("flash")]
        if ratios:
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            speed.append(f"{'forward' if direction == 'fwd' else 'backward'} {geo:.2f}x")
    verdict = "CORRECT" if not failed else f"{len(failed)} INCORRECT"
    print(f"verdict: {verdict}; speed vs PyTorch's flash backend (geometric mean): {', '.join(speed) or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
