"""python -m cuteflash.info: what this build of cuteflash holds, and the local GPU."""

from __future__ import annotations

import sys


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


def main() -> int:
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
