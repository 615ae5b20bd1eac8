"""Two builds of the compiled module in one process, timed sample by sample on the benchmark's rows: how a kernel
change is shown to cost nothing (docs/contributing.md).

    python -m cuteflash.bench_compare OTHER/_C.cpython-312-x86_64-linux-gnu.so [--suites baselines,decode]

"new" is the installed package's module, "old" the other build's (a _C*.so of the same binding), loaded beside it.
A planned call keeps the launch of the module that planned it, so each build has its own cache of plans
(interface._plans, swapped with the module) and, for the backward rows, its own autograd graph. Each row of the
baselines, options, varlen and decode suites is timed in rounds that alternate old and new (old first in even
rounds, new first in odd ones); a sample is a GPU sleep, then back-to-back calls worth --ms
milliseconds. A row's figure is the median over rounds of new/old, the two samples of a round being next to each
other in time, so that the GPU's clock drift between rounds cancels, with the quartiles of those ratios.
Comparing a build with a copy of itself (copy the .so to another path) shows the method's noise on this GPU.
CUTEFLASH_BACKEND picks the family, as for every call.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
from functools import partial

SUITES = ("baselines", "options", "varlen", "decode")


def load_module(path: str, name: str = "cuteflash_other._C"):
    """The compiled module at path, loaded under another name than the installed one."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ValueError(f"{path} is not a compiled module")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def paired_ratios(old: list[float], new: list[float]) -> tuple[float, float, float]:
    """The median of new[i] / old[i] over rounds i, and its first and third quartiles."""
    ratios = sorted(n / o for o, n in zip(old, new))
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


class Comparison:
    def __init__(self, old_module, rounds: int, ms: float):
        import torch

        from . import _lib, interface

        self.lib, self.interface = _lib, interface
        self.modules = {"old": old_module, "new": _lib.compiled_module()}
        # A plan holds the launch of the module that made it: each build plans its own calls.
        self.plans = {"old": {}, "new": interface._plans}
        self.rounds, self.ms = rounds, ms
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        family = _lib.select_family(torch.device("cuda"))
        self.backward = "bwd" in _lib.build_info()["families"][family]["directions"]

    def use(self, build: str) -> None:
        self.lib._C = self.modules[build]
        self.interface._plans = self.plans[build]

    def _sample(self, fn, calls: int) -> float:
        import torch

        torch.cuda._sleep(1_000_000)  # the host queues the calls ahead of the GPU
        self.start.record()
        for _ in range(calls):
            fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / calls

    def row(self, name: str, fn) -> None:
        """fn: the call, or {build: its call} where a call holds what one build made (an autograd graph). A row that one
        build does not compute (an older build whose kernels refuse the call) is reported and left out."""
        fns = fn if isinstance(fn, dict) else {"old": fn, "new": fn}
        try:
            for build in ("old", "new"):  # each build's first call (its per-device setup, its plan) is not timed
                self.use(build)
                try:
                    fns[build]()
                except (ValueError, NotImplementedError) as e:  # (an older build's kernels that refuse the call)
                    print(f"{name:46s} not compared: the {build} build does not compute it ({e})")
                    return
            calls = max(2, min(400, int(self.ms / max(self._sample(fns["new"], 2), 1e-3))))
            times = {"old": [], "new": []}
            for r in range(self.rounds):
                for build in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    self.use(build)
                    times[build].append(self._sample(fns[build], calls))
        finally:
            self.use("new")
        median, q1, q3 = paired_ratios(times["old"], times["new"])
        old_ms, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{name:46s} old {old_ms:9.4f} ms  new {new_ms:9.4f} ms  new/old {median:.4f} [{q1:.4f}, {q3:.4f}]")

    def both_directions(self, name: str, fwd, qkv) -> None:
        import torch

        with torch.no_grad():
            self.row(f"{name} fwd", partial(fwd, *qkv))
        if not self.backward:  # (a family still being built may have no backward pass)
            return
        # A graph per build: the planned calls' autograd keeps the plan (so the launches) that its forward call used.
        graphs = {}
        try:
            for build in ("old", "new"):
                self.use(build)
                leaves = [t.detach().requires_grad_() for t in qkv]
                graphs[build] = (fwd(*leaves), leaves)
        finally:
            self.use("new")
        dout = torch.randn_like(graphs["new"][0])
        calls = {
            build: partial(torch.autograd.grad, out, leaves, dout, retain_graph=True)
            for build, (out, leaves) in graphs.items()
        }
        self.row(f"{name} bwd", calls)


def built_for(family: str, info: dict) -> set:
    """The (dtype, kernel head dim) pairs of the family's forward kernels in this build (build_info()), dtypes as
    torch's: a developer's build may hold a few (CUTEFLASH_DTYPES, CUTEFLASH_HEADDIMS)."""
    import torch

    return {
        (getattr(torch, k["dtype"]), k["head_dim"])  # build_info's names are torch's: float16, bfloat16
        for k in info["kernels"]
        if k["family"] == family and k["direction"] == "fwd"
    }


def run(c: Comparison, suites, pairs) -> int:
    """Times the suites' rows whose (dtype, head dim) this build holds (pairs, built_for); returns how many groups
    of rows (a shape's, a suite's) it timed."""
    import torch

    from . import bench, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    timed = 0

    def built(name: str, dtype, head_dim: int) -> bool:
        nonlocal timed
        if (dtype, head_dim) not in pairs:
            print(f"{name:46s} skipped: this build has no {dtype} kernel for head dim {head_dim}")
            return False
        timed += 1
        return True

    dtypes = sorted({dt for dt, _ in pairs}, key=str, reverse=True)  # float16 first
    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.")
        if "baselines" in suites:
            for b, h, s, d in bench.SUITES["baselines"]:
                if not built(f"{dt} {b}x{h}x{s}x{d}", dtype, d):
                    continue
                qkv = [randn(b, s, h, d, dtype=dtype) for _ in range(3)]
                for causal in (False, True):
                    shape = f"{dt} {b}x{h}x{s}x{d}{' causal' if causal else ''}"
                    c.both_directions(shape, partial(flash_attn_func, causal=causal), qkv)
        if "options" in suites and built(f"{dt} options", dtype, bench.OPTIONS_SHAPE[3]):
            b, h, s, d = bench.OPTIONS_SHAPE
            qkv = [randn(b, s, h, d, dtype=dtype) for _ in range(3)]
            slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
            for name, options in {"plain": {}, **bench.OPTIONS}.items():
                options = dict(options, alibi_slopes=slopes) if name == "alibi" else options
                c.both_directions(f"{dt} causal {name}", partial(flash_attn_func, causal=True, **options), qkv)
        if "varlen" in suites:
            tokens, shortest, longest, h, d = bench.VARLEN_MIXED
            if built(f"{dt} varlen mixed", dtype, d):
                lengths = bench._varlen_lengths(tokens, shortest, longest)
                cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
                qkv = [randn(tokens, h, d, dtype=dtype) for _ in range(3)]
                mixed = partial(flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
                c.both_directions(
                    f"{dt} varlen mixed", partial(mixed, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths)), qkv
                )
            for b, h, s, d in bench.VARLEN_EQUAL:
                if not built(f"{dt} varlen {b}x{h}x{s}x{d}", dtype, d):
                    continue
                cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
                qkv = [randn(b * s, h, d, dtype=dtype) for _ in range(3)]
                equal = partial(flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
                c.both_directions(f"{dt} varlen {b}x{h}x{s}x{d}", partial(equal, max_seqlen_q=s, max_seqlen_k=s), qkv)
        if "decode" in suites and dtype == torch.float16 and built("decode", dtype, bench.DECODE_HEAD_DIM):
            h, d = bench.DECODE_HEADS, bench.DECODE_HEAD_DIM
            for b, keys, queries in bench.DECODE_SHAPES:
                q = randn(b, queries, h, d)
                seqlens = torch.full((b,), keys, dtype=torch.int32, device="cuda")
                caches = {"": (randn(b, keys, h, d), randn(b, keys, h, d), None)}
                for page in bench.DECODE_PAGES:
                    table = torch.randperm(b * keys // page, device="cuda", dtype=torch.int32).view(b, -1)
                    caches[f" paged {page}"] = (
                        randn(b * keys // page, page, h, d),
                        randn(b * keys // page, page, h, d),
                        table,
                    )
                with torch.no_grad():
                    for tag, (kc, vc, table) in caches.items():
                        call = partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=seqlens, block_table=table)
                        c.row(f"decode {b}x{queries}x{keys}{tag}", call)
                del caches
    return timed


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m cuteflash.bench_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the other build's compiled module (a _C*.so file)")
    p.add_argument("--suites", default=",".join(SUITES), help="comma-separated, of %(default)s")
    p.add_argument("--rounds", type=int, default=16, help="rounds per row (default: %(default)s)")
    p.add_argument("--ms", type=float, default=4.0, help="GPU milliseconds per sample (default: %(default)s)")
    args = p.parse_args(argv)
    suites = args.suites.split(",")
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        p.error(f"unknown suites {unknown}; choose from {', '.join(SUITES)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from . import _lib

    family = _lib.select_family(torch.device("cuda"))
    pairs = built_for(family, _lib.build_info())
    backend = os.environ.get(_lib.BACKEND_ENV, "auto")
    print(f"{torch.cuda.get_device_name()}, family {family} ({_lib.BACKEND_ENV}={backend})")
    if not run(Comparison(load_module(args.old), args.rounds, args.ms), suites, pairs):
        print(f"nothing timed: this build has no {family} forward kernel that the rows need")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
