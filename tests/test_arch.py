"""TORCH_CUDA_ARCH_LIST parsing (python/cuteflash/_arch.py, which CMake runs): no GPU or nvcc needed."""

import dataclasses
import subprocess
import sys

import pytest

from cuteflash import _arch, _families
from cuteflash._arch import ArchError, Target, parse


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
    assert Target(90, "a").cmake() == ["90a-real"]


# ---- A family that comes alongside another (sm90: sm_90a code beside the sm80 family's for 9.0).


@pytest.fixture
def unreleased_sm90(monkeypatch):
    families = tuple(dataclasses.replace(f, released=False) if f.name == "sm90" else f for f in _families.FAMILIES)
    monkeypatch.setattr(_families, "FAMILIES", families)


@pytest.mark.parametrize(
    "arch_list,sm80,sm90",
    [
        ("9.0", ["9.0"], ["9.0a"]),
        ("9.0+PTX", ["9.0+PTX"], ["9.0a"]),  # (machine code only: sm_90a code runs on no other GPU)
        ("Hopper", ["9.0+PTX"], ["9.0a"]),
        ("9.0a", ["9.0a"], ["9.0a"]),
        ("8.0;9.0;10.0", ["8.0", "9.0", "10.0"], ["9.0a"]),
        ("8.0;8.6", ["8.0", "8.6"], []),
    ],
)
def test_a_released_alongside_family_takes_its_targets_beside_the_other(arch_list, sm80, sm90):
    sel = parse(arch_list, cuda=(12, 9))
    assert (targets(sel, "sm80"), targets(sel, "sm90")) == (sm80, sm90)
    assert not sel.notes
    assert _arch.family_of(90) == "sm80"


def test_a_toolkit_too_old_for_an_alongside_family_leaves_it_out_with_a_note():
    sel = parse("9.0;9.0+PTX", cuda=(12, 2))
    assert (targets(sel, "sm80"), targets(sel, "sm90")) == (["9.0+PTX"], [])
    assert sel.notes == ["the sm90 kernels need CUDA 12.3 or newer; found CUDA 12.2: not built for 9.0"]
    assert targets(parse("9.0", cuda=(12, 3)), "sm90") == ["9.0a"]


def test_an_unreleased_alongside_family_gets_only_its_extra_targets(unreleased_sm90):
    sel = parse("8.0;9.0+PTX", cuda=(12, 9))
    assert (targets(sel, "sm80"), targets(sel, "sm90"), sel.notes) == (["8.0", "9.0+PTX"], [], [])
    sel = parse("9.0", cuda=(12, 9), extra={"sm90": "9.0"})
    assert (targets(sel, "sm80"), targets(sel, "sm90")) == (["9.0"], ["9.0a"])


@pytest.mark.parametrize("extra", ["9.0", "9.0+PTX", "9.0a", "Hopper"])
def test_extra_targets_of_a_family_take_its_suffix(extra):
    sel = parse("8.0", cuda=(12, 9), extra={"sm90": extra})
    assert targets(sel, "sm90") == ["9.0a"] and targets(sel, "sm80") == ["8.0"]


def test_extra_targets_a_family_cannot_build_are_refused():
    with pytest.raises(ArchError, match=r"the sm90 kernels need CUDA 12\.3 or newer; found CUDA 12\.2"):
        parse("9.0", cuda=(12, 2), extra={"sm90": "9.0"})  # (asked for: an error, not a note)
    with pytest.raises(ArchError, match=r"'8\.0' of the sm90 family: its kernels are compiled for 9\.0a only"):
        parse("8.0", cuda=(12, 9), extra={"sm90": "8.0"})


def test_cmake_mode_prints_the_defines_and_the_extra_targets_with_their_suffix():
    out = run_cmake_mode("9.0", "--cuda-version", "12.9", "--extra", "sm90=9.0")
    assert 'set(CUTEFLASH_FAMILIES "sm80;sm90")' in out
    assert 'set(CUTEFLASH_SM80_ARCHS "90-real")' in out and 'set(CUTEFLASH_SM90_ARCHS "90a-real")' in out
    assert 'set(CUTEFLASH_SM90_TARGETS "9.0a")' in out and 'set(CUTEFLASH_SM80_DEFINES "")' in out
    assert 'set(CUTEFLASH_SM90_DEFINES "NDEBUG;CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED")' in out
    assert "set(CUTEFLASH_ARCH_NOTES)" in out


def test_cmake_mode_prints_the_notes_as_a_list(capsys):
    assert _arch.main(["--cmake", "9.0", "--cuda-version", "12.2"]) == 0
    out = capsys.readouterr().out
    note = "the sm90 kernels need CUDA 12.3 or newer, found CUDA 12.2: not built for 9.0"  # (a ';' would split it)
    assert f"set(CUTEFLASH_ARCH_NOTES [=[{note}]=])" in out
    assert 'set(CUTEFLASH_FAMILIES "sm80")' in out


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
    assert 'set(CUTEFLASH_FAMILIES "sm70;sm80;sm75;sm90")' in out and 'set(CUTEFLASH_SM90_ARCHS "90a-real")' in out
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
