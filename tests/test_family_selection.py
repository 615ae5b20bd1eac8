"""Which kernel family serves a GPU, and the errors when the build cannot serve it (torch's device
queries are faked, so these run without a GPU)."""

import pytest
import torch

from cuteflash import _lib


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(cc, name, families, runs=True):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        info = {"families": {f: {"targets": t.split()} for f, t in families.items()}}
        monkeypatch.setattr(_lib, "build_info", lambda: info)
        # runs: whether the compiled code runs on this GPU, for every family or for the families named
        runs_here = (lambda family: runs) if isinstance(runs, bool) else (lambda family: family in runs)
        monkeypatch.setattr(_lib, "_family_runs", lambda family, index: runs_here(family))
        monkeypatch.setattr(_lib, "_selected", {})
        monkeypatch.delenv(_lib.BACKEND_ENV, raising=False)

    return install


def test_ampere_and_newer_take_sm80(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H200", {"sm70": "7.0 7.5", "sm80": "8.0 9.0"})
    assert _lib.select_family(0) == "sm80"


def test_turing_takes_sm75_where_compiled_and_sm70_otherwise(fake_gpu):
    fake_gpu((7, 5), "Tesla T4", {"sm70": "7.0", "sm75": "7.5", "sm80": "8.0"})
    assert _lib.select_family(0) == "sm75"
    fake_gpu((7, 5), "Tesla T4", {"sm70": "7.0 7.5", "sm80": "8.0"})  # a build from before the sm75 family
    assert _lib.select_family(0) == "sm70"


def test_a_family_compiled_only_for_other_gpus_is_passed_over(fake_gpu):
    # a developer's build: sm75 only for 9.0, sm70 for 7.5
    fake_gpu((7, 5), "Tesla T4", {"sm70": "7.5", "sm75": "9.0", "sm80": "9.0"}, runs={"sm70"})
    assert _lib.select_family(0) == "sm70"


def test_volta_takes_sm70(fake_gpu):
    fake_gpu((7, 0), "Tesla V100", {"sm70": "7.0", "sm75": "7.5", "sm80": "8.0"})
    assert _lib.select_family(0) == "sm70"


def test_family_not_compiled_names_capability_and_rebuild(fake_gpu):
    fake_gpu((7, 0), "Tesla V100", {"sm80": "8.0 9.0"})
    with pytest.raises(RuntimeError, match=r"no sm70 kernels.*7\.0.*TORCH_CUDA_ARCH_LIST='7\.0'"):
        _lib.select_family(0)


def test_targets_that_do_not_run_here(fake_gpu):
    fake_gpu((8, 6), "NVIDIA A10", {"sm80": "9.0a"}, runs=False)
    with pytest.raises(RuntimeError, match=r"compiled for 9\.0a, which cannot run on NVIDIA A10.*'8\.6'"):
        _lib.select_family(0)


def test_pre_volta_is_refused(fake_gpu):
    fake_gpu((6, 1), "GeForce GTX 1080", {"sm70": "7.0", "sm80": "8.0"})
    with pytest.raises(RuntimeError, match="needs 7.0"):
        _lib.select_family(0)


def test_backend_override(fake_gpu, monkeypatch):
    fake_gpu((9, 0), "NVIDIA H200", {"sm70": "7.5 9.0", "sm80": "9.0"})
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm70")
    assert _lib.select_family(0) == "sm70"
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm90")
    with pytest.raises(ValueError, match="CUTEFLASH_BACKEND='sm90'"):
        _lib.select_family(0)


def test_sm80_cannot_be_forced_on_turing(fake_gpu, monkeypatch):
    fake_gpu((7, 5), "Tesla T4", {"sm70": "7.5", "sm80": "8.0"})
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm80")
    with pytest.raises(RuntimeError, match="need compute capability 8.0"):
        _lib.select_family(0)
