"""The installed package: the extension links neither libtorch nor a shared CUDA runtime, build_info
describes it, and the package metadata asks for what the issue says."""

import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cuteflash._families import NAMES

ROOT = Path(__file__).resolve().parents[1]


def extension_path():
    spec = importlib.util.find_spec("cuteflash._C")
    if spec is None or spec.origin is None:
        pytest.skip("cuteflash._C is not built (source checkout without 'pip install .')")
    return spec.origin


def elf_needed(path):
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_offset + val)
                needed.append(data[strtab_offset + val : end].decode())
    return needed


def test_extension_links_no_torch_and_no_shared_cudart():
    needed = elf_needed(extension_path())
    assert needed, "no DT_NEEDED entries found: the ELF reader is broken"
    assert "libc.so.6" in needed
    for lib in needed:
        assert not lib.startswith(("libtorch", "libc10", "libcudart")), f"the extension depends on {lib}"


def test_build_info_describes_the_build():
    extension_path()
    import cuteflash

    info = cuteflash.build_info()
    assert set(info) == {"families", "cuda_version", "kernels"}
    assert info["families"], "no kernel family compiled in"
    for family, entry in info["families"].items():
        assert family in NAMES
        assert entry["targets"], f"{family} has no targets"
        assert set(entry["dtypes"]) <= {"float16", "bfloat16"}
        assert all(d in (32, 64, 96, 128, 160, 192, 224, 256) for d in entry["head_dims"])
    assert int(info["cuda_version"].split(".")[0]) >= 11


def test_fresh_interpreter_imports_and_reports():
    # Loading the extension before torch once crashed torch's import; a fresh process checks the order.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-m", "cuteflash.info"], capture_output=True, text=True, env=env, cwd=ROOT.parent
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("cuteflash ")


def test_pyproject_declares_build_and_runtime_requirements():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = " ".join(meta["build-system"]["requires"])
    for name in ("scikit-build-core", "pybind11", "nvidia-cutlass", "cmake", "ninja"):
        assert name in requires
    assert meta["build-system"]["build-backend"] == "scikit_build_core.build"
    assert "torch>=2.4" in meta["project"]["dependencies"]
    assert "pytest" in " ".join(meta["project"]["optional-dependencies"]["test"])
    assert meta["project"]["scripts"]["cuteflash-bench"] == "cuteflash.bench:main"


def test_wheel_carries_its_license_and_cutlass_s():
    """The installed distribution holds LICENSE and CUTLASS's notice (its headers are compiled into the module)."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution("cuteflash").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cuteflash is not installed")
    names = {Path(str(f)).name for f in files if ".dist-info" in str(f)}
    assert {"LICENSE", "CUTLASS-LICENSE.txt"} <= names, sorted(names)
    assert "NVIDIA" in (ROOT / "licenses" / "CUTLASS-LICENSE.txt").read_text()


def test_info_check_fails_where_the_kernels_cannot_serve(monkeypatch, capsys):
    """python -m cuteflash.info --check (the wheels' test command) exits 1 when the module does not load or a
    required family lacks kernels, and 0 when the build holds them (no GPU: nothing to run)."""
    torch = pytest.importorskip("torch")
    from cuteflash import _lib, info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    both = {
        "families": {f: {"targets": ["8.0"], "directions": ["bwd", "fwd"]} for f in ("sm70", "sm80")},
        "cuda_version": "12.9",
        "kernels": [],
    }
    monkeypatch.setattr(info, "describe", lambda: "cuteflash (test)")
    monkeypatch.setattr(_lib, "build_info", lambda: both)
    assert info.main(["--check", "--family", "sm70", "--family", "sm80"]) == 0
    assert "check passed" in capsys.readouterr().out
    forward_only = {**both, "families": {"sm80": {"targets": ["8.0"], "directions": ["fwd"]}}}
    monkeypatch.setattr(_lib, "build_info", lambda: forward_only)
    assert info.main(["--check", "--family", "sm80"]) == 1
    assert info.main(["--check", "--family", "sm70"]) == 1
    assert "no sm70 forward and backward kernels" in capsys.readouterr().out

    def unloadable():
        raise RuntimeError("cuteflash's compiled module could not be loaded")

    monkeypatch.setattr(_lib, "build_info", unloadable)
    assert info.main(["--check"]) == 1
    assert "does not load" in capsys.readouterr().out
    assert info.main([]) == 0  # without --check it only reports
