"""The family registry: the one place that names cuteflash's kernel families.

A family is a set of kernels written for one range of GPUs, in its own folder, ``include/cuteflash/<name>/``, and
compiled only for its own targets. Everything that must know the families reads this table:

- the build: ``_arch.py`` (which targets of TORCH_CUDA_ARCH_LIST go to which family, and which CUDA toolkits can
  build them), CMakeLists.txt (through ``_arch.py --cmake``: one kernel library per family, its build-time
  estimate) and ``src/kernels/generate.py`` (one source per family, direction, dtype and head dim; the dispatch
  table and the registry the binding reads, ``host/registry.h``);
- run time: ``_lib.select_family`` (the family for a device), ``_lib.call_family`` (the family that computes a call:
  ``computing_family``, the rule for a family that hands some calls to another), ``_ops`` (dtypes, fp16 correction),
  the benchmark and ``cuteflash.info``.

It needs nothing but the standard library: CMake runs it inside an isolated build environment.

What a family's folder provides (the generated sources include these by name):

- ``fwd_launch.cuh``, ``bwd_launch.cuh`` (of the directions it has), ``decode_launch.cuh`` (unless it launches
  another family's decoding kernel: ``decode_from``): ``<name>::run_fwd``, ``run_bwd`` and ``run_decode``, each
  ``template <typename Element, int kHeadDim> void (Params const&, cudaStream_t)``;
- ``tiles.h``: its tile table and ``<name>::FamilyTraits``, host-safe constants the host plans with
  (``kDecode``, but where it launches another family's decoding kernel, ``kRowsumInDq``, ``split_tile``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# What a call may use beyond a plain one (a fixed-length batch without options or cache): a variable-length batch
# (cu_seqlens), each of the options (a sliding window, softcap, ALiBi, dropout), a KV cache (read, paged, or appended
# to), an operand read in place with a stride of 0 over more than one element (an expanded tensor; TMA takes no such
# stride), a deterministic backward pass.
FEATURES = ("varlen", "window", "softcap", "alibi", "dropout", "cache", "broadcast", "deterministic")


class Slower(NamedTuple):
    """The calls of one direction that use every one of `features`, at kernel head dims up to head_dim_max."""

    direction: str
    features: tuple[str, ...]
    head_dim_max: int


@dataclass(frozen=True)
class Family:
    name: str
    # The compute capabilities (70 for 7.0) the family serves, inclusive; cc_max None: every newer one. Where several
    # families serve a GPU, the one with the highest cc_min is preferred (and gets its targets, unless alongside).
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
    # Every target of the family is built as X.Y + arch_suffix, machine code only, never PTX: "a" for code of one
    # architecture's own instructions (sm_90a: wgmma, setmaxnreg), which no other GPU runs and no driver JIT-compiles.
    arch_suffix: str = ""
    # The family takes its GPUs' targets beside the family that otherwise serves them, rather than taking them away
    # (TORCH_CUDA_ARCH_LIST=9.0: sm80 for 9.0 and sm90 for 9.0a): that family computes the calls this one does not
    # (delegate), and serves the GPU where the toolkit cannot build this one.
    alongside: bool = False
    # Compile definitions of the family's kernel library.
    defines: tuple[str, ...] = ()
    # The family that computes the calls this one does not take (takes); None: this family computes every call of
    # its directions itself.
    delegate: str | None = None
    # What a call may use (FEATURES) and still be computed by this family rather than by its delegate (read only where
    # it has one).
    features: tuple[str, ...] = FEATURES
    # The family whose decoding kernel (include/cuteflash/decode/: fixed-length calls with few query rows) this one
    # launches rather than compile its own: its delegate, beside which it is built (alongside), so that the kernel is
    # compiled for the same GPUs once. None: its own, compiled with each of its forward kernels.
    decode_from: str | None = None
    # The kernel head dims a direction's kernels are compiled for, where not every one (a family with a delegate hands
    # the others to it).
    head_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Calls the family computes more slowly than its delegate (measured): CUTEFLASH_BACKEND=auto hands them to it; a
    # family forced by name computes them itself.
    slower: tuple[Slower, ...] = ()

    def serves(self, cc: int) -> bool:
        return self.cc_min <= cc and (self.cc_max is None or cc <= self.cc_max)

    def has_kernel(self, direction: str, head_dim: int) -> bool:
        """Whether the family has a kernel of this direction ("fwd", "bwd") and kernel head dim."""
        return direction in self.directions and head_dim in self.head_dims.get(direction, (head_dim,))


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
    Family(
        name="sm90",
        cc_min=90,
        cc_max=90,
        dtypes=("fp16", "bf16"),
        directions=("fwd", "bwd"),
        cuda_min=(12, 3),
        cuda_max=None,
        fp16_correction=False,
        # (CUDA 13, sm_90a, 2-core x86, 2026-11-28: forward 33-44 s a file at every head dim and dtype, backward 33-38)
        build_seconds={"fwd": 38, "bwd": 35},
        summary="Hopper: TMA, wgmma and warp specialisation (sm_90a)",
        arch_suffix="a",
        alongside=True,
        # NDEBUG: CUTLASS's and CuTe's run-time assert()s stay out of the kernels. The extended shapes: a wgmma of any
        # N that is a multiple of 8 (the tiles' 112 and 80 keys), where CuTe otherwise takes several narrower ones.
        defines=("NDEBUG", "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"),
        delegate="sm80",  # (whose lse and out are laid out alike: its backward takes this family's forward)
        # (A deterministic pass: its dK/dV kernel, then the sm80 family's dQ kernel.)
        # (KV caches: a variable-length batch's unpaged cache is read as an expanded tensor: broadcast.)
        features=("varlen", "window", "softcap", "alibi", "dropout", "cache", "deterministic"),
        # (Softcap with dropout at head dims 32 and 64: its backward kernel spills several hundred bytes of registers.)
        slower=(Slower("bwd", ("softcap", "dropout"), 64),),
        decode_from="sm80",
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


class Call(NamedTuple):
    """What the rule (takes) reads of a kernel call. dtype and head_dim None: a call of no one kernel (the dropout
    mask that return_attn_probs draws), which a family with a delegate leaves to it."""

    direction: str  # "fwd" (the decoding kernel and the cache append included) or "bwd"
    dtype: str | None  # "fp16" or "bf16"
    head_dim: int | None  # the kernel head dim that computes it (_lib.kernel_head_dim); None above the largest
    varlen: bool = False  # a variable-length batch (cu_seqlens)
    window: bool = False  # a sliding window (a side of window_size bounded)
    softcap: bool = False
    alibi: bool = False  # ALiBi slopes
    dropout: bool = False
    cache: bool = False  # reads a KV cache (paged or not), or appends to one
    broadcast: bool = False  # an operand with a stride of 0 over a dimension of more than one element
    deterministic: bool = False  # a backward pass asked to be bitwise reproducible


def takes(family: Family, call: Call, compiled_kernels, forced: bool = False) -> bool:
    """Whether family computes call itself rather than hand it to its delegate: always for a family without one;
    else where the family has the call's direction, computes every feature the call uses (features), and its
    kernel of that direction, dtype and head dim is compiled in, and, unless the family was forced by name, the call
    is not one it computes more slowly (slower). compiled_kernels: the build's (family, direction, dtype, head dim)
    of each compiled kernel, in the registry's names (fp16, bf16)."""
    if family.delegate is None:
        return True
    used = {name for name in FEATURES if getattr(call, name)}
    slower = any(
        call.direction == s.direction and set(s.features) <= used and (call.head_dim or 0) <= s.head_dim_max
        for s in family.slower
    )
    return (
        call.direction in family.directions
        and used <= set(family.features)
        and (family.name, call.direction, call.dtype, call.head_dim) in compiled_kernels
        and (forced or not slower)
    )


def computing_family(name: str, call: Call, compiled_kernels, forced: bool = False) -> str:
    """The family that computes call where family `name` was chosen for the device (forced: by name): that one where
    it takes the call, else, in turn, the family it delegates to (takes)."""
    family = get(name)
    while not takes(family, call, compiled_kernels, forced):
        family, forced = get(family.delegate), False
    return family.name
