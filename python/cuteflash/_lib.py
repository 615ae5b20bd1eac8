"""The compiled module, what it was built with, and the choice of kernel family for a device."""

from __future__ import annotations

import functools
import os

import torch  # noqa: F401  (before _C: torch's import crashed when our pybind11 module was loaded first)

from . import _families

try:
    from . import _C
except ImportError as e:  # a source checkout, or a build for another Python
    _C = None
    _C_ERROR = e

BACKEND_ENV = "CUTEFLASH_BACKEND"


@functools.cache
def kernel_head_dims() -> tuple[int, ...]:
    """The head dims with a kernel in the tile table (include/cuteflash/common/tiles.h), compiled in or not."""
    return tuple(compiled_module().build_info()["kernel_head_dims"])


def kernel_head_dim(head_dim: int) -> int | None:
    """The kernel head dim that serves head_dim: the smallest that holds it after padding to a multiple of 8
    (round_up_head_dim in common/tiles.h); None above the largest."""
    padded = -(-head_dim // 8) * 8
    return next((hd for hd in kernel_head_dims() if hd >= padded), None)


def compiled_module():
    if _C is None:
        raise RuntimeError(
            f"cuteflash's compiled module could not be loaded ({_C_ERROR}). Install the package with "
            "'pip install .' from the source folder (a CUDA toolkit is needed to build it)."
        )
    return _C


@functools.cache
def build_info() -> dict:
    """What this build of cuteflash holds.

    Returns a dict with ``families`` ({family: {"targets": [...], "dtypes": [...], "head_dims": [...],
    "directions": [...]}}), ``cuda_version`` (the toolkit that built it) and ``kernels`` (one dict per
    compiled launcher: family, direction, dtype, head_dim).
    """
    raw = compiled_module().build_info()
    families = {}
    for family, targets in raw["families"].items():
        families[family] = {"targets": targets.split(), "dtypes": set(), "head_dims": set(), "directions": set()}
    for kernel in raw["kernels"]:
        entry = families[kernel["family"]]
        entry["dtypes"].add(kernel["dtype"])
        entry["head_dims"].add(kernel["head_dim"])
        entry["directions"].add(kernel["direction"])
    for entry in families.values():
        for key in ("dtypes", "head_dims", "directions"):
            entry[key] = sorted(entry[key])
    return {"families": families, "cuda_version": raw["cuda_version"], "kernels": list(raw["kernels"])}


def _cc_text(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _rebuild_hint(cc: tuple[int, int]) -> str:
    return f"rebuild with TORCH_CUDA_ARCH_LIST='{_cc_text(cc)}' pip install --no-build-isolation ."


def _family_runs(family: str, device_index: int) -> bool:
    with torch.cuda.device(device_index):
        return compiled_module().family_runs(family)


_selected: dict = {}


def select_family(device) -> str:
    """The kernel family for a CUDA device: the registry's (_families.py) preferred family for its compute
    capability among those compiled in for it, or the one that ``CUTEFLASH_BACKEND`` (auto or a family's name) forces.
    Raises if it cannot run there.
    Called on every kernel launch, so the answer is cached per (device, CUTEFLASH_BACKEND)."""
    key = (_device_index(device), os.environ.get(BACKEND_ENV, "auto") or "auto")
    family = _selected.get(key)
    if family is None:
        family = _selected[key] = _select_family(*key)
    return family


def _device_index(device) -> int:
    """The index of a CUDA device given as a torch.device, an index or a name (the current one where it has none)."""
    if isinstance(device, torch.device):
        index = device.index
    else:
        index = device if isinstance(device, int) else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _select_family(index: int, forced: str) -> str:
    cc = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if forced not in ("auto",) + _families.NAMES:
        raise ValueError(f"{BACKEND_ENV}={forced!r} is not one of auto, {', '.join(_families.NAMES)}")
    cc_code = cc[0] * 10 + cc[1]
    serving = _families.serving(cc_code)
    if not serving:
        raise RuntimeError(
            f"{name} has compute capability {_cc_text(cc)}; cuteflash needs "
            f"{_families.cc_text(_families.LOWEST_CC)} (Volta) or newer"
        )
    families = build_info()["families"]
    if forced == "auto":
        # the preferred family compiled in whose code runs here (a developer's build may hold a family only for another
        # GPU); else the preferred one compiled in, or the preferred one, for the messages below
        compiled = [f.name for f in serving if f.name in families]
        family = next((f for f in compiled if _family_runs(f, index)), compiled[0] if compiled else serving[0].name)
    else:
        family = forced
        low = _families.get(family).cc_min
        if cc_code < low:  # (a newer GPU runs an older family's code where it was compiled for it)
            raise RuntimeError(
                f"the {family} kernels need compute capability {_families.cc_text(low)} or newer; {name} has "
                f"{_cc_text(cc)}"
            )

    _require_runs(family, index, cc, name)
    return family


def _require_runs(family: str, index: int, cc: tuple[int, int], name: str) -> None:
    """Raises where the build has no code of family that runs on device index (name, compute capability cc)."""
    families = build_info()["families"]
    if family not in families:
        compiled = ", ".join(families) or "none"
        raise RuntimeError(
            f"this cuteflash build has no {family} kernels (compiled families: {compiled}), which {name} "
            f"(compute capability {_cc_text(cc)}) needs; {_rebuild_hint(cc)}"
        )
    if not _family_runs(family, index):
        targets = " ".join(families[family]["targets"])
        raise RuntimeError(
            f"cuteflash's {family} kernels were compiled for {targets}, which cannot run on {name} "
            f"(compute capability {_cc_text(cc)}); {_rebuild_hint(cc)}"
        )


@functools.cache
def compiled_kernels() -> frozenset:
    """(family, direction, dtype, kernel head dim) of each compiled kernel, dtypes in the registry's names (fp16,
    bf16): what the registry's rule reads (_families.takes)."""
    names = {str(dtype).removeprefix("torch."): code for dtype, code in _DTYPE_NAMES.items()}  # float16: fp16
    return frozenset((k["family"], k["direction"], names[k["dtype"]], k["head_dim"]) for k in build_info()["kernels"])


_delegated: dict = {}


def call_family(device, call: _families.Call, family: str | None = None) -> str:
    """The family that computes call on a CUDA device: `family` (default: select_family's), or where that one hands
    the call on (the registry's rule, _families.computing_family; a family that CUTEFLASH_BACKEND names keeps the calls
    it computes more slowly), the family it goes to, checked as select_family checks its own. Cached per (device,
    family, call, forced or not)."""
    family = family or select_family(device)
    if _families.get(family).delegate is None:
        return family
    index = _device_index(device)
    forced = os.environ.get(BACKEND_ENV, "auto") == family  # (it computes the calls it is slower at too)
    key = (index, family, call, forced)
    computing = _delegated.get(key)
    if computing is None:
        computing = _families.computing_family(family, call, compiled_kernels(), forced)
        if computing != family:
            cc = torch.cuda.get_device_capability(index)
            _require_runs(computing, index, cc, torch.cuda.get_device_name(index))
        _delegated[key] = computing
    return computing


# The registry's names of the dtypes the kernels take.
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_supported(family: str, dtype: torch.dtype) -> bool:
    """Whether the family's kernels compute dtype (the registry's dtypes)."""
    return _DTYPE_NAMES.get(dtype) in _families.get(family).dtypes


def check_dtype(family: str, dtype: torch.dtype) -> None:
    """Raises TypeError where the family's kernels do not compute dtype, a dtype the kernels take (interface.py
    refuses the others)."""
    code = _DTYPE_NAMES.get(dtype)
    if code is None or code in _families.get(family).dtypes:
        return
    with_it = [f for f in _families.FAMILIES if code in f.dtypes]
    low = min(f.cc_min for f in with_it)
    raise TypeError(
        f"{dtype} needs a GPU of compute capability {_families.cc_text(low)}+ (the {with_it[0].name} kernels); this "
        f"GPU runs the {family} kernels: use float16"
    )
