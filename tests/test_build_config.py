"""CMake's configure step fails with a message a user can act on (needs cmake and nvcc, no GPU)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = os.environ.get("CUDACXX") or shutil.which("nvcc")
# The cmake of this Python's environment (the pip package) comes first: the system one may be too old.
CMAKE = shutil.which("cmake", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r"(\d+)\.(\d+)", text).groups())


def _cmake_too_old() -> bool:
    """Whether CMAKE is older than CMakeLists.txt's cmake_minimum_required (`pip install cmake` brings a newer one)."""
    wanted = re.search(r"cmake_minimum_required\(VERSION ([\d.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)
    found = subprocess.run([CMAKE, "--version"], capture_output=True, text=True).stdout
    return _version(found) < _version(wanted)


pytestmark = [
    pytest.mark.skipif(
        not (CMAKE and NVCC and (ROOT / "CMakeLists.txt").exists()), reason="needs cmake, nvcc and the source tree"
    ),
    pytest.mark.skipif(
        bool(CMAKE) and (ROOT / "CMakeLists.txt").exists() and _cmake_too_old(),
        reason="the cmake found is older than CMakeLists.txt needs: pip install cmake",
    ),
]


def nvcc_version():
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    release = out.split("release ")[1].split(",")[0]
    return tuple(int(x) for x in release.split("."))


def configure(tmp_path, *defines, nvcc=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "CUTLASS_INCLUDE_DIR")}
    r = subprocess.run(
        [
            CMAKE,
            "-S",
            ROOT,
            "-B",
            tmp_path / "build",
            f"-DCMAKE_CUDA_COMPILER={nvcc or NVCC}",
            f"-DPython_EXECUTABLE={sys.executable}",
            *defines,
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    return r.returncode, " ".join((r.stdout + r.stderr).split())  # CMake wraps long messages


def test_unknown_entry(tmp_path):
    rc, log = configure(tmp_path, "-DTORCH_CUDA_ARCH_LIST=8.0;sm_90")
    assert rc != 0
    assert "TORCH_CUDA_ARCH_LIST entry 'sm_90' is not understood" in log


def test_pre_volta_entry(tmp_path):
    rc, log = configure(tmp_path, "-DTORCH_CUDA_ARCH_LIST=6.1")
    assert rc != 0 and "cuteflash needs Volta (7.0) or newer" in log


@pytest.mark.skipif(nvcc_version() < (13, 0) if NVCC else True, reason="needs CUDA 13's nvcc")
def test_volta_with_cuda_13(tmp_path):
    rc, log = configure(tmp_path, "-DTORCH_CUDA_ARCH_LIST=7.0;8.0")
    assert rc != 0 and "Volta (7.0) needs CUDA 11.8–12.9" in log


def test_missing_cutlass(tmp_path):
    rc, log = configure(tmp_path, "-DTORCH_CUDA_ARCH_LIST=8.0", f"-DCUTLASS_INCLUDE_DIR={tmp_path / 'nowhere'}")
    assert rc != 0 and "pip install nvidia-cutlass" in log and "-DCUTLASS_INCLUDE_DIR" in log


def test_failing_nvcc_shows_its_error(tmp_path):
    """A CUDA compiler that cannot compile: the message carries the compiler's own error output."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'ptxas fatal: this toolkit is broken' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    rc, log = configure(tmp_path, "-DTORCH_CUDA_ARCH_LIST=8.0", nvcc=nvcc)
    assert rc != 0 and f"the CUDA compiler {nvcc} cannot compile a kernel" in log
    assert "ptxas fatal: this toolkit is broken" in log and "CUDACXX" in log


def test_configure_estimates_time_and_finds_the_kernel_cache(tmp_path, monkeypatch):
    """A good configure says what it compiles and about how long it takes; with CUTEFLASH_KERNEL_CACHE it keys
    the kernels, and once the key's library is there, a configure plans to compile nothing."""
    pybind11 = pytest.importorskip("pybind11")
    pytest.importorskip("cutlass_library")
    monkeypatch.setenv("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    cache = tmp_path / "kernel-cache"
    defines = [
        "-DTORCH_CUDA_ARCH_LIST=8.0",
        "-DCUTEFLASH_HEADDIMS=64",
        f"-DCUTEFLASH_KERNEL_CACHE={cache}",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
    ]
    rc, log = configure(tmp_path, *defines)
    assert rc == 0, log
    assert "6 kernel files (head dims: 64), 6 kernel compilations" in log
    assert re.search(r"about \d+ min with 2 parallel jobs \(a rough estimate\)", log)
    entry = Path(re.search(r"the kernels will be kept in the cache, (\S+)", log).group(1))
    assert entry.parent == cache
    entry.mkdir(parents=True)
    (entry / "libcuteflash_kernels.a").write_bytes(b"!<arch>\n")  # the library a build would have left
    rc, log = configure(tmp_path / "again", *defines)
    assert rc == 0, log
    assert f"kernels from the cache, {entry / 'libcuteflash_kernels.a'}: nothing to compile" in log
