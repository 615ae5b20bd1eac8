"""python -m cuteflash.info: what this build of cuteflash holds, and the local GPU."""

from __future__ import annotations

import argparse
import sys

from . import _families


def describe() -> str:
    from . import __version__
    from ._lib import build_info, select_family

    lines = [f"cuteflash {__version__}"]
    try:
        info = build_info()
    except RuntimeError as e:
        return "\n".join(lines + [f"compiled module: not available ({e})"])
    lines.append(f"built with CUDA {info['cuda_version']}")
    for family, entry in info["families"].items():
        lines.append(
            f"family {family}: targets {' '.join(entry['targets'])}; "
            f"{', '.join(entry['directions']) or 'no kernels'}; dtypes {', '.join(entry['dtypes']) or '-'}; "
            f"head dims {', '.join(map(str, entry['head_dims'])) or '-'}"
        )
    try:
        import torch
    except ImportError:
        return "\n".join(lines + ["torch: not installed"])
    if not torch.cuda.is_available():
        return "\n".join(lines + [f"torch {torch.__version__}: no CUDA GPU visible"])
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        try:
            verdict = f"runs the {select_family(i)} kernels"
        except (RuntimeError, ValueError) as e:
            verdict = f"cannot run cuteflash: {e}"
        lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)} (compute capability {cc[0]}.{cc[1]}): {verdict}")
    return "\n".join(lines)


def check(families: list[str]) -> list[str]:
    """Why this install cannot serve its users, if it cannot: the compiled module does not load, a family in
    `families` (default: any) lacks the kernels of a direction the family has (_families.py; a family still being
    built may have no backward pass), or a visible GPU fails a small attention call
    against PyTorch's. Empty when all is well; for a wheel's test command."""
    from ._lib import build_info

    try:
        info = build_info()
    except RuntimeError as e:
        return [f"the compiled module does not load: {e}"]
    problems = []
    compiled = info["families"]
    for family in families or ([] if compiled else [" or ".join(_families.NAMES)]):
        entry = compiled.get(family)
        wanted = set(_families.get(family).directions) if family in _families.NAMES else {"fwd", "bwd"}
        if entry is None or not wanted <= set(entry["directions"]):
            kinds = " and ".join({"fwd": "forward", "bwd": "backward"}[d] for d in sorted(wanted, reverse=True))
            problems.append(f"no {family} {kinds} kernels in this build")
    try:
        import torch
    except ImportError:
        return problems
    if not torch.cuda.is_available():
        return problems
    from . import flash_attn_func

    for i in range(torch.cuda.device_count()):
        try:
            q, k, v = (torch.randn(1, 128, 2, 64, device=f"cuda:{i}", dtype=torch.float16) for _ in range(3))
            out = flash_attn_func(q, k, v, causal=True)
            expected = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True
            ).transpose(1, 2)
            error = (out.float() - expected).abs().max().item()
            if not error < 1e-2:
                problems.append(f"GPU {i}: the attention call is off by {error:.3g}")
        except Exception as e:  # any failure to run is what the check reports
            problems.append(f"GPU {i}: {type(e).__name__}: {e}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuteflash.info", description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 unless the kernels load (and, on each visible GPU, compute a small call correctly)",
    )
    parser.add_argument(
        "--family",
        action="append",
        choices=_families.NAMES,
        default=[],
        help="with --check: a family that must be compiled in (repeatable; default: any)",
    )
    args = parser.parse_args(argv)
    print(describe())
    if not args.check:
        return 0
    problems = check(args.family)
    for problem in problems:
        print(f"check failed: {problem}")
    if not problems:
        print("check passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
