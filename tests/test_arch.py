"""TORCH_CUDA_ARCH_LIST parsing (python/cuteflash/_arch.py, which CMake runs): no GPU or nvcc needed."""

import subprocess
import sys

import pytest

from cuteflash import _arch
from cuteflash._arch import ArchError, parse


def targets(sel, family):
    return [str(t) for t in sel.targets[family]]


@pytest.mark.parametrize(
    "arch_list,sm70,sm75,sm80",
    [
        ("8.0;9.0", [], [], ["8.0", "9.0"]),
        ("7.0 7.5", ["7.0"], ["7.5"], []),
        ("7.0;7.5 8.0", ["7.0"], ["7.5"], ["8.0"]),
        (";;8.6;; ;", [], [], ["8.6"]),
        ("8.0+PTX", [], [], ["8.0+PTX"]),
        ("9.0a", [], [], ["9.0a"]),
        ("9.0a;9.0+PTX", [], [], ["9.0+PTX", "9.0a"]),
        ("8.0;8.0+PTX", [], [], ["8.0+PTX"]),
        ("7.2", ["7.2"], [], []),
        ("10.0;12.0", [], [], ["10.0", "12.0"]),
    ],
)
def test_good_lists(arch_list, sm70, sm75, sm80):
    sel = parse(arch_list, cuda=(12, 9))
    assert (targets(sel, "sm70"), targets(sel, "sm75"), targets(sel, "sm80")) == (sm70, sm75, sm80)


@pytest.mark.parametrize(
    "name,sm70,sm75,sm80",
    [
        ("Volta", ["7.0+PTX"], [], []),
        ("Turing", [], ["7.5+PTX"], []),
        ("Ampere", [], [], ["8.0", "8.6+PTX"]),
        ("Ada", [], [], ["8.9+PTX"]),
        ("Hopper", [], [], ["9.0+PTX"]),
        ("Volta+Tegra", ["7.2"], [], []),
        ("Ampere+Tegra", [], [], ["8.7"]),
        ("Volta;Hopper", ["7.0+PTX"], [], ["9.0+PTX"]),
    ],
)
def test_named_arches_expand_as_pytorch(name, sm70, sm75, sm80):
    sel = parse(name, cuda=(12, 9))
    assert (targets(sel, "sm70"), targets(sel, "sm75"), targets(sel, "sm80")) == (sm70, sm75, sm80)


@pytest.mark.parametrize(
    "junk,message",
    [
        ("sm_80", "not understood"),
        ("8", "not understood"),
        ("8.0+ptx", "not understood"),
        ("80", "not understood"),
        ("banana", "not understood"),
        ("9.9", "unknown"),
        ("6.1", "needs Volta"),
        ("Pascal", "needs Volta"),
        ("5.2", "needs Volta"),
        ("", "no entries"),
        (" ; ", "no entries"),
    ],
)
def test_junk_is_rejected_with_a_reason(junk, message):
    with pytest.raises(ArchError, match=message):
        parse(junk, cuda=(12, 9))


def test_volta_needs_cuda_12_9_or_older():
    with pytest.raises(ArchError, match="Volta .* needs CUDA 11.8–12.9"):
        parse("7.0", cuda=(13, 0))
    with pytest.raises(ArchError, match="needs CUDA 11.8–12.9"):
        parse("Volta", cuda=(13, 0))
    assert targets(parse("7.5", cuda=(13, 0)), "sm75") == ["7.5"]  # Turing stays in CUDA 13
    assert targets(parse("7.0", cuda=(11, 8)), "sm70") == ["7.0"]


def test_toolkit_too_old_for_target():
    with pytest.raises(ArchError, match="needs CUDA 12.8 or newer"):
        parse("10.0", cuda=(12, 4))
    with pytest.raises(ArchError, match="needs CUDA 11.8 or newer"):
        parse("8.0", cuda=(11, 7))


def test_extra_targets_go_to_the_named_family():
    sel = parse("7.5", cuda=(13, 0), extra={"sm70": "9.0"})
    assert targets(sel, "sm70") == ["9.0"] and targets(sel, "sm75") == ["7.5"]
    assert targets(sel, "sm80") == []
    with pytest.raises(ArchError, match="unknown kernel family"):
        parse("8.0", extra={"sm60": "9.0"})


def test_cmake_architecture_items():
    sel = parse("8.6+PTX;9.0a", cuda=(12, 9))
    assert [item for t in sel.targets["sm80"] for item in t.cmake()] == ["86-real", "86-virtual", "90a-real"]


@pytest.mark.parametrize("cuda", [(11, 8), (12, 9), (13, 0)])
def test_default_list_covers_every_family_the_toolkit_builds(cuda):
    sel = parse(_arch.default_arch_list(cuda), cuda=cuda)
    assert sel.targets["sm75"] and sel.targets["sm80"]
    assert bool(sel.targets["sm70"]) == (cuda < (13, 0))  # CUDA 13 dropped Volta


def run_cmake_mode(*args):
    out = subprocess.run(
        [sys.executable, _arch.__file__, "--cmake", *args], capture_output=True, text=True, check=True
    ).stdout
    return out


def test_cmake_mode_prints_set_commands():
    out = run_cmake_mode("7.5;8.0;9.0+PTX", "--cuda-version", "13.0", "--extra", "sm70=9.0", "--extra", "sm80=")
    assert 'set(CUTEFLASH_FAMILIES "sm70;sm80;sm75")' in out
    assert 'set(CUTEFLASH_SM70_ARCHS "90-real")' in out and 'set(CUTEFLASH_SM75_ARCHS "75-real")' in out
    assert 'set(CUTEFLASH_SM80_ARCHS "80-real;90-real;90-virtual")' in out
    assert 'set(CUTEFLASH_SM80_TARGETS "8.0 9.0+PTX")' in out
    assert "CUTEFLASH_ARCH_ERROR" not in out


def test_cmake_mode_lists_only_families_with_targets():
    out = run_cmake_mode("8.0", "--cuda-version", "13.0")
    assert 'set(CUTEFLASH_FAMILIES "sm80")' in out and 'set(CUTEFLASH_SM70_ARCHS "")' in out


def test_cmake_mode_rejects_an_unknown_family_in_extras():
    out = run_cmake_mode("8.0", "--cuda-version", "13.0", "--extra", "sm60=9.0")
    assert "set(CUTEFLASH_ARCH_ERROR" in out and "unknown kernel family 'sm60'" in out


def test_cmake_mode_reports_errors_for_cmake_to_raise():
    out = run_cmake_mode("7.0", "--cuda-version", "13.0")
    assert "set(CUTEFLASH_ARCH_ERROR" in out and "Volta" in out


def test_cli_lists_families():
    out = subprocess.run(
        [sys.executable, _arch.__file__, "Volta;8.0", "--cuda-version", "12.9"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "sm70: 7.0+PTX" in out and "sm80: 8.0" in out


def test_cmake_mode_without_list_uses_visible_gpus_or_the_default(monkeypatch):
    visible = _arch.visible_gpu_arch_list()
    out = run_cmake_mode("", "--cuda-version", "13.0")
    if visible:
        assert "visible GPUs" in out
    else:
        assert "default (no GPU visible): " + _arch.DEFAULT_ARCH_LIST["cuda13"] in out
        assert 'set(CUTEFLASH_SM75_TARGETS "7.5")' in out
