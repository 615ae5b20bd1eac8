"""The family registry (python/cuteflash/_families.py): the one place that names a kernel family. Each family's
folder provides what the generated sources include, and no other build or host file names a family."""

import ast
import re
from pathlib import Path

import pytest

from cuteflash import _families

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "include" / "cuteflash"

pytestmark = pytest.mark.skipif(not INCLUDE.exists(), reason="needs the source tree")


@pytest.mark.parametrize("family", _families.NAMES)
def test_each_family_folder_provides_the_launchers_and_traits(family):
    folder = INCLUDE / family
    own_decode = _families.get(family).decode_from is None
    for direction in (*_families.get(family).directions, *(["decode"] if own_decode else [])):
        text = (folder / f"{direction}_launch.cuh").read_text()
        assert f"namespace cuteflash::{family}" in text and f"void run_{direction}(" in text
    assert (folder / "decode_launch.cuh").exists() == own_decode  # (no unused launcher)
    tiles = (folder / "tiles.h").read_text()
    assert f"namespace cuteflash::{family}" in tiles and "struct FamilyTraits" in tiles
    for constant in ("kRowsumInDq", "split_tile", *(["kDecode"] if own_decode else [])):
        assert constant in tiles
    assert own_decode or "kDecode" not in tiles  # (the host plans with decode_from's)


def test_entries_are_consistent():
    assert len(set(_families.NAMES)) == len(_families.NAMES)
    for family in _families.FAMILIES:
        assert set(family.dtypes) <= set(_families.DTYPES) and family.dtypes
        assert set(family.directions) <= set(_families.DIRECTIONS) and family.directions
        assert family.cc_max is None or family.cc_max >= family.cc_min
        assert set(family.build_seconds) == {*family.directions, *(["decode"] if family.decode_from is None else [])}
        assert family.arch_suffix in ("", "a", "f") and set(family.features) <= set(_families.FEATURES)
        # a family beside another hands it the calls it lacks
        assert family.delegate in (None, *_families.NAMES) and (not family.alongside or family.delegate)
        # another family's decoding kernel is launched only where it is compiled for the same GPUs: the delegate of a
        # family beside it
        assert family.decode_from is None or (family.alongside and family.decode_from == family.delegate)


@pytest.mark.parametrize(
    "cc,preferred", [(70, "sm70"), (75, "sm75"), (80, "sm80"), (86, "sm80"), (90, "sm90"), (120, "sm80"), (61, None)]
)
def test_the_preferred_family_of_a_gpu(cc, preferred):
    serving = _families.serving(cc)
    assert (serving[0].name if serving else None) == preferred


def test_a_family_still_being_built_serves_only_where_asked(monkeypatch):
    import dataclasses

    from cuteflash import _arch

    # Every family is released today: try each as if it were not.
    released = _families.FAMILIES
    for name in _families.NAMES:
        families = tuple(dataclasses.replace(f, released=False) if f.name == name else f for f in released)
        monkeypatch.setattr(_families, "FAMILIES", families)
        assert all(name not in [f.name for f in _families.serving(cc)] for cc in range(70, 130))
        # (the targets some released family serves on its own, not only alongside another)
        served = [t for t in ("7.0", "7.5", "9.0") if any(not f.alongside for f in _families.serving(int(t[0] + t[2])))]
        sel = _arch.parse(";".join(served), (12, 9))  # (a target no released family serves is refused)
        assert not sel.targets[name]
        sel = _arch.parse(served[-1], (12, 9), {name: served[-1]})
        assert [str(t) for t in sel.targets[name]] == [served[-1] + _families.get(name).arch_suffix]


def _python_code_names(path: Path, pattern: re.Pattern) -> list[str]:
    """The string constants (docstrings aside) and identifiers of a Python file that match pattern."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        else:
            continue
        if pattern.search(text):
            found.append(f"{path.name}:{node.lineno}: {text!r}")
    return found


def _cpp_names(paths, pattern: re.Pattern) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(re.split(r"//|#", line, maxsplit=1)[0]):
                found.append(f"{path.name}:{number}: {line.strip()}")
    return found


FAMILY_NAME = re.compile(r"\b(" + "|".join(_families.NAMES) + r")\b", re.IGNORECASE)


def test_no_other_build_or_host_file_names_a_family():
    # Family names in code (string literals, identifiers) outside the registry and the family folders: the binding,
    # the generator, CMake, the shared and host headers, and the Python that selects and calls the kernels.
    # Comments and docstrings may name them.
    paths = [ROOT / "CMakeLists.txt", ROOT / "src" / "api.cpp", *(INCLUDE / "common").iterdir(),
             *(INCLUDE / "host").iterdir()]  # fmt: skip
    found = _cpp_names(paths, FAMILY_NAME)
    for name in ("_arch.py", "_lib.py", "_ops.py", "info.py", "bench.py", "interface.py"):
        found += _python_code_names(ROOT / "python" / "cuteflash" / name, FAMILY_NAME)
    found += _python_code_names(ROOT / "src" / "kernels" / "generate.py", FAMILY_NAME)
    assert not found, "named outside the registry:\n" + "\n".join(found)


def test_the_decoding_kernel_names_no_family():
    assert not _cpp_names(sorted((INCLUDE / "decode").iterdir()), FAMILY_NAME)


def test_shared_headers_include_no_family_or_host_header():
    # The device code every family shares (common/, and decode/ but for its launcher) includes neither a family's
    # headers nor the host's; the host's headers include no family's.
    family_dir = re.compile(r'#include\s+"cuteflash/(' + "|".join(_families.NAMES) + r")/")
    host_dir = re.compile(r'#include\s+"cuteflash/host/')
    device = [*(INCLUDE / "common").iterdir(), *(p for p in (INCLUDE / "decode").iterdir() if p.name != "launch.cuh")]
    found = []
    for path in device + list((INCLUDE / "host").iterdir()):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if family_dir.search(line) or (path in device and host_dir.search(line)):
                found.append(f"{path.relative_to(INCLUDE)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_kernel_has_internal_linkage():
    """Each generated source launches only the kernels it instantiates, and two families' libraries, compiled for
    different targets, instantiate some of the same kernel templates (the backward's preprocess, the split merge; the
    sm75 family runs the sm70 family's backward above head dim 128). Before CUDA 13, nvcc gives a template kernel's
    host stub weak linkage: the linker keeps one, and the runtime would launch that one library's code on every GPU.
    static keeps each source's own."""
    root = Path(__file__).resolve().parents[1] / "include" / "cuteflash"
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.cuh")) + sorted(root.rglob("*.h"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "__global__" in line and not line.lstrip().startswith("//") and not line.startswith("static __global__")
    ]
    assert not found, f"kernels without static: {found}"
