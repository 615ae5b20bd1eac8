"""Parsing of TORCH_CUDA_ARCH_LIST into cuteflash's kernel families.

This file is the one source of truth for architecture selection: CMake runs it at configure time
(``python _arch.py --cmake ...``) and the package imports it at run time to word its error messages.
It needs nothing but the standard library, so it runs inside an isolated build environment.

Why not CMake's own architecture handling (CMAKE_CUDA_ARCHITECTURES, "native"): it takes CMake's grammar
(``80-real;90-virtual``), not the TORCH_CUDA_ARCH_LIST that users of PyTorch extensions already set, and it has
no notion of the kernel families (_families.py) that split the targets; the targets chosen here are handed to CMake as
each family library's CUDA_ARCHITECTURES, which then builds them as it would its own.

Grammar (PyTorch's, ``torch.utils.cpp_extension``): entries separated by ``;`` or spaces; each entry is
``X.Y``, ``X.Y+PTX``, ``X.Ya`` / ``X.Yf`` (arch-specific / family-specific targets), or one of PyTorch's
names (Volta, Turing, Ampere, Ada, Hopper, ...), which expand as PyTorch expands them. Empty entries are
ignored.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field

# As PyTorch expands them (torch.utils.cpp_extension.named_arches).
NAMED_ARCHES = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5+PTX",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX",
    "Volta+Tegra": "7.2",
    "Volta": "7.0+PTX",
    "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
}

try:
    from . import _families
except ImportError:  # run as a script (CMake): _families.py lies beside this file
    import _families

FAMILIES = _families.NAMES

# Compute capabilities nvcc knows, with the first CUDA release that builds them and the last one
# (None: still supported). CUDA 13.0 dropped sm_70/sm_72 and renamed sm_101 to sm_110.
KNOWN_ARCHES = {
    70: ((9, 0), (12, 9)),
    72: ((10, 0), (12, 9)),
    75: ((10, 0), None),
    80: ((11, 0), None),
    86: ((11, 1), None),
    87: ((11, 4), None),
    88: ((13, 0), None),
    89: ((11, 8), None),
    90: ((11, 8), None),
    100: ((12, 8), None),
    101: ((12, 8), (12, 9)),
    103: ((12, 9), None),
    110: ((13, 0), None),
    120: ((12, 8), None),
    121: ((12, 9), None),
}

MIN_CUDA = (11, 8)

# Used when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible at build time: every family the
# toolkit can build, with PTX of the newest entry so future GPUs JIT-compile it.
DEFAULT_ARCH_LIST = {
    "cuda12": "7.0;7.5;8.0;8.6;8.9;9.0+PTX",
    "cuda13": "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX",
}


class ArchError(ValueError):
    """An arch list entry that cuteflash cannot build, with a message a user can act on."""


@dataclass(frozen=True)
class Target:
    cc: int  # 75 for compute capability 7.5
    suffix: str = ""  # "", "a" or "f"
    ptx: bool = False

    @property
    def family(self) -> str:
        return family_of(self.cc)

    def cmake(self) -> list[str]:
        """CMake CUDA_ARCHITECTURES items: machine code, plus PTX where asked."""
        items = [f"{self.cc}{self.suffix}-real"]
        if self.ptx:
            items.append(f"{self.cc}{self.suffix}-virtual")
        return items

    def __str__(self) -> str:
        text = _families.cc_text(self.cc) + self.suffix
        return text + "+PTX" if self.ptx else text


@dataclass
class Selection:
    targets: dict[str, list[Target]] = field(default_factory=lambda: {f: [] for f in FAMILIES})
    # What the build leaves out without failing, for CMake to show: a family beside another (alongside) that the
    # toolkit cannot build.
    notes: list[str] = field(default_factory=list)

    def add(self, target: Target, family: str | None = None) -> None:
        family = family or target.family
        bucket = self.targets[family]
        for i, old in enumerate(bucket):
            if old.cc == target.cc and old.suffix == target.suffix:
                bucket[i] = Target(old.cc, old.suffix, old.ptx or target.ptx)
                return
        bucket.append(target)
        bucket.sort(key=lambda t: (t.cc, t.suffix))


def family_of(cc: int) -> str:
    """The family whose kernels a target of compute capability cc gets (_families.serving's first that does not come
    alongside another)."""
    serving = [f for f in _families.serving(cc) if not f.alongside]
    if not serving:
        raise ArchError(
            f"compute capability {_families.cc_text(cc)} is not supported: cuteflash needs Volta "
            f"({_families.cc_text(_families.LOWEST_CC)}) or newer"
        )
    return serving[0].name


_ENTRY = re.compile(r"^(\d+)\.(\d)([af]?)(\+PTX)?$")


def expand_names(arch_list: str) -> list[str]:
    """Split on ';' and spaces, drop empty entries and expand PyTorch's arch names."""
    entries: list[str] = []
    for raw in arch_list.replace(" ", ";").split(";"):
        if not raw:
            continue
        if raw in NAMED_ARCHES:
            entries.extend(NAMED_ARCHES[raw].split(";"))
        else:
            entries.append(raw)
    return entries


def parse_entry(entry: str) -> Target:
    m = _ENTRY.match(entry)
    if not m:
        names = ", ".join(NAMED_ARCHES)
        raise ArchError(
            f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not understood: use X.Y, X.Y+PTX, X.Ya "
            f"(e.g. '8.0;9.0a;9.0+PTX') or one of {names}"
        )
    cc = int(m.group(1)) * 10 + int(m.group(2))
    if cc not in KNOWN_ARCHES:
        if cc < 70:
            family_of(cc)  # raises the 'needs Volta or newer' message
        raise ArchError(
            f"TORCH_CUDA_ARCH_LIST entry {entry!r}: compute capability {m.group(1)}.{m.group(2)} is "
            f"unknown; known ones are " + ", ".join(_families.cc_text(c) for c in KNOWN_ARCHES)
        )
    family_of(cc)
    return Target(cc, m.group(3), bool(m.group(4)))


def check_toolkit(target: Target, cuda: tuple[int, int] | None) -> None:
    if cuda is None:
        return
    first, last = KNOWN_ARCHES[target.cc]
    v = _version_text(cuda)
    if last is not None and cuda > last:
        if target.cc in (70, 72):
            raise ArchError(
                f"Volta ({target}) needs CUDA 11.8–12.9; the CUDA toolkit found is {v}, which dropped "
                "Volta. Install CUDA 12.9 or older and point CUDACXX at its nvcc, or remove 7.0/7.2 "
                "from TORCH_CUDA_ARCH_LIST."
            )
        raise ArchError(f"compute capability {target} needs CUDA {last[0]}.{last[1]} or older; found CUDA {v}")
    if cuda < first:
        raise ArchError(
            f"compute capability {target} needs CUDA {first[0]}.{first[1]} or newer; found CUDA {v}. "
            "Install a newer CUDA toolkit or drop that entry from TORCH_CUDA_ARCH_LIST."
        )
    if target.suffix == "f" and cuda < (12, 9):
        raise ArchError(f"family-specific target {target} needs CUDA 12.9 or newer; found CUDA {v}")


def family_toolkit_problem(family: str, cuda: tuple[int, int] | None) -> str | None:
    """Why the toolkit cannot build the family's code (_families.Family.cuda_min, cuda_max), or None where it can
    (or its version is not known)."""
    f = _families.get(family)
    if cuda is None or (f.cuda_min <= cuda and (f.cuda_max is None or cuda <= f.cuda_max)):
        return None
    upper = f" to {_version_text(f.cuda_max)}" if f.cuda_max else " or newer"
    return f"the {family} kernels need CUDA {_version_text(f.cuda_min)}{upper}; found CUDA {_version_text(cuda)}"


def check_family_toolkit(family: str, cuda: tuple[int, int] | None) -> None:
    """Raises where the toolkit cannot build the family's code."""
    problem = family_toolkit_problem(family, cuda)
    if problem is not None:
        raise ArchError(problem)


def add_alongside(sel: Selection, target: Target, cuda: tuple[int, int] | None) -> None:
    """Gives each released family that comes alongside another and serves target's GPU its own target there (X.Y and
    its arch_suffix, machine code), or, where the toolkit cannot build the family, a note in its place."""
    for f in _families.serving(target.cc):
        if not f.alongside:
            continue
        problem = family_toolkit_problem(f.name, cuda)
        if problem is None:
            sel.add(Target(target.cc, f.arch_suffix), f.name)
        else:
            note = f"{problem}: not built for {_families.cc_text(target.cc)}"
            if note not in sel.notes:
                sel.notes.append(note)


def extra_target(family: str, entry: str) -> Target:
    """A developer's extra target for a family: a family with an arch_suffix is built for X.Y + suffix only (machine
    code), and only for the compute capabilities it serves (no other GPU runs that code)."""
    target = parse_entry(entry)
    f = _families.get(family)
    if not f.arch_suffix:
        return target
    if not f.serves(target.cc):
        served = _families.cc_text(f.cc_min) if f.cc_max == f.cc_min else f"{_families.cc_text(f.cc_min)}+"
        raise ArchError(
            f"extra target {entry!r} of the {family} family: its kernels are compiled for {served}{f.arch_suffix} only"
        )
    return Target(target.cc, f.arch_suffix)


def _version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def default_arch_list(cuda: tuple[int, int] | None) -> str:
    return DEFAULT_ARCH_LIST["cuda13" if cuda is not None and cuda >= (13, 0) else "cuda12"]


def parse(
    arch_list: str,
    cuda: tuple[int, int] | None = None,
    extra: dict[str, str] | None = None,
) -> Selection:
    """Map an arch list to per-family targets; `extra` adds developer targets to a family."""
    if cuda is not None and cuda < MIN_CUDA:
        raise ArchError(f"cuteflash needs CUDA 11.8 or newer; found CUDA {cuda[0]}.{cuda[1]}")
    sel = Selection()
    entries = expand_names(arch_list)
    if not entries:
        raise ArchError("TORCH_CUDA_ARCH_LIST has no entries; unset it to build for the visible GPUs")
    for entry in entries:
        target = parse_entry(entry)
        check_toolkit(target, cuda)
        sel.add(target)
        add_alongside(sel, target, cuda)
    for family, extra_list in (extra or {}).items():
        if family not in FAMILIES:
            raise ArchError(f"unknown kernel family {family!r}; families are {', '.join(FAMILIES)}")
        for entry in expand_names(extra_list):
            target = extra_target(family, entry)
            check_toolkit(target, cuda)
            sel.add(target, family)
    # (a family with targets the toolkit cannot build is an error: its extra targets were asked for)
    for family, targets in sel.targets.items():
        if targets:
            check_family_toolkit(family, cuda)
    return sel


def visible_gpu_arch_list() -> str:
    """Compute capabilities of the GPUs visible now, as an arch list ('' if none or no driver)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    caps = sorted({line.strip() for line in out.splitlines() if _ENTRY.match(line.strip())})
    return ";".join(caps)


def _parse_version(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _cmake_main(args: argparse.Namespace) -> int:
    cuda = _parse_version(args.cuda_version)
    source = "TORCH_CUDA_ARCH_LIST"
    arch_list = args.arch_list
    if not arch_list.strip():
        arch_list, source = visible_gpu_arch_list(), "visible GPUs"
        if not arch_list:
            arch_list, source = default_arch_list(cuda), "default (no GPU visible)"
    extra = {}
    for item in args.extra:
        family, _, targets = item.partition("=")
        if targets.strip():
            extra[family] = targets
    try:
        sel = parse(arch_list, cuda, extra)
    except ArchError as e:
        print(f"set(CUTEFLASH_ARCH_ERROR [=[{e}]=])")
        return 0
    print(f"set(CUTEFLASH_ARCH_SOURCE [=[{source}: {arch_list}]=])")
    notes = "".join(f" [=[{note}]=]" for note in (n.replace(";", ",") for n in sel.notes))  # (a list: ';' would split)
    print(f"set(CUTEFLASH_ARCH_NOTES{notes})")
    print(f'set(CUTEFLASH_FAMILIES "{";".join(f for f in FAMILIES if sel.targets[f])}")')
    for family in FAMILIES:
        targets = sel.targets[family]
        items = [item for t in targets for item in t.cmake()]
        print(f'set(CUTEFLASH_{family.upper()}_ARCHS "{";".join(items)}")')
        print(f'set(CUTEFLASH_{family.upper()}_TARGETS "{" ".join(str(t) for t in targets)}")')
        print(f'set(CUTEFLASH_{family.upper()}_DEFINES "{";".join(_families.get(family).defines)}")')
        for kind, seconds in _families.get(family).build_seconds.items():
            print(f"set(CUTEFLASH_{family.upper()}_SECONDS_{kind.upper()} {seconds})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arch_list", nargs="?", default="", help="TORCH_CUDA_ARCH_LIST value")
    p.add_argument("--cuda-version", default="", help="toolkit version, e.g. 12.9")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="FAMILY=TARGETS",
        help="extra targets for a family, as <family>=9.0 (developers; CUTEFLASH_<FAMILY>_EXTRA_ARCHS)",
    )
    p.add_argument("--families", action="store_true", help="print the families' names, ';'-separated")
    p.add_argument("--cmake", action="store_true", help="print CMake set() commands")
    args = p.parse_args(argv)
    if args.families:
        print(";".join(FAMILIES))
        return 0
    if args.cmake:
        return _cmake_main(args)
    try:
        sel = parse(
            args.arch_list or default_arch_list(_parse_version(args.cuda_version)), _parse_version(args.cuda_version)
        )
    except ArchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for family in FAMILIES:
        print(f"{family}: {' '.join(str(t) for t in sel.targets[family]) or '-'}")
    for note in sel.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
