"""The family registry: the one place that names cuteflash's kernel families.

A family is a set of kernels written for one range of GPUs, in its own folder, ``include/cuteflash/<name>/``, and
compiled only for its own targets. Everything that must know the families reads this table:

- the build: ``_arch.py`` (which targets of TORCH_CUDA_ARCH_LIST go to which family, and which CUDA toolkits can
  build them), CMakeLists.txt (through ``_arch.py --cmake``: one kernel library per family, its build-time
  estimate) and ``src/kernels/generate.py`` (one source per family, direction, dtype and head dim; the dispatch
  table and the registry the binding reads, ``host/registry.h``);
- run time: ``_lib.select_family`` (the family for a device), ``_ops`` (dtypes, fp16 correction), the benchmark and
  ``cuteflash.info``.

It needs nothing but the standard library: CMake runs it inside an isolated build environment.

What a family's folder provides (the generated sources include these by name):

- ``fwd_launch.cuh``, ``bwd_launch.cuh``, ``decode_launch.cuh``: ``<name>::run_fwd``, ``run_bwd`` and
  ``run_decode``, each ``template <typename Element, int kHeadDim> void (Params const&, cudaStream_t)``;
- ``tiles.h``: its tile table and ``<name>::FamilyTraits``, host-safe constants the host plans with
  (``kDecode``, ``kRowsumInDq``, ``split_tile``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    # The compute capabilities (70 for 7.0) the family serves, inclusive; cc_max None: every newer one. Where several
    # families serve a GPU, the one with the highest cc_min is chosen.
    cc_min: int
    cc_max: int | None
    dtypes: tuple[str, ...]
    directions: tuple[str, ...]
    # The CUDA toolkits that build its code (major, minor), inclusive; None: no upper bound. (Which toolkits build a
    # target is _arch.KNOWN_ARCHES's.)
    cuda_min: tuple[int, int]
    cuda_max: tuple[int, int] | None
    # An fp32 x that feeds a tensor-core product is split into hi = fp16(x) and lo = fp16((x - hi) * 2^11), for fp32
    # accuracy from fp16 products (CUTEFLASH_SM70_CORRECTION=0 turns it off).
    fp16_correction: bool
    # Seconds of one core to compile a file of each kind for one target, for the build's time estimate: measured on a
    # 2-core x86 machine (sm80: CUDA 13, head dim 64, one target; sm70: CUDA 11.8, every head dim, 7.0+PTX); larger
    # head dims take longer, so a rough guide.
    build_seconds: dict[str, int]
    summary: str
    # False for a family still being built: TORCH_CUDA_ARCH_LIST gives it no target (only its
    # CUTEFLASH_<NAME>_EXTRA_ARCHS do) and CUTEFLASH_BACKEND=auto never takes it; CUTEFLASH_BACKEND=<name> runs it.
    released: bool = True

    def serves(self, cc: int) -> bool:
        return self.cc_min <= cc and (self.cc_max is None or cc <= self.cc_max)


FAMILIES: tuple[Family, ...] = (
    Family(
        name="sm70",
        cc_min=70,
        cc_max=79,
        dtypes=("fp16",),
        directions=("fwd", "bwd"),
        cuda_min=(11, 8),
        cuda_max=None,  # (CUDA 13 builds it for 7.5 and newer; _arch.KNOWN_ARCHES says which toolkit builds 7.0)
        fp16_correction=True,
        build_seconds={"fwd": 29, "bwd": 22, "decode": 4},
        summary="Volta (and Turing where the sm75 family is not compiled): WMMA products, error-corrected fp16",
    ),
    Family(
        name="sm80",
        cc_min=80,
        cc_max=None,
        dtypes=("fp16", "bf16"),
        directions=("fwd", "bwd"),
        cuda_min=(11, 8),
        cuda_max=None,
        fp16_correction=False,
        build_seconds={"fwd": 125, "bwd": 250, "decode": 10},
        summary="Ampere and newer: ldmatrix, mma.m16n8k16 and cp.async",
    ),
    Family(
        name="sm75",
        cc_min=75,
        cc_max=79,
        dtypes=("fp16",),
        directions=("fwd", "bwd"),
        cuda_min=(11, 8),
        cuda_max=None,
        fp16_correction=False,
        build_seconds={"fwd": 125, "bwd": 250, "decode": 4},  # (the sm80 family's: the same kernels)
        summary="Turing: ldmatrix and mma.m16n8k8 (the sm80 family's kernels with Turing's atoms)",
    ),
)

NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
LOWEST_CC = min(f.cc_min for f in FAMILIES)  # the oldest GPU any family serves
DTYPES = ("fp16", "bf16")
DIRECTIONS = ("fwd", "bwd")


def get(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"unknown kernel family {name!r}; families are {', '.join(NAMES)}")


def cc_text(cc: int) -> str:
    """Compute capability 75 as "7.5"."""
    return f"{cc // 10}.{cc % 10}"


def serving(cc: int) -> list[Family]:
    """The released families that serve compute capability cc (70 for 7.0), preferred first."""
    return sorted((f for f in FAMILIES if f.released and f.serves(cc)), key=lambda f: -f.cc_min)
