"""Which kernel family serves a GPU, which family computes a call (the registry's rule for a family that hands some
calls to another), and the errors when the build cannot serve it (torch's device queries are faked, so these run
without a GPU)."""

import dataclasses

import pytest
import torch

from cuteflash import _families, _lib, _ops
from cuteflash._families import Call


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
        monkeypatch.setattr(_lib, "_delegated", {})
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
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm60")
    with pytest.raises(ValueError, match="CUTEFLASH_BACKEND='sm60'"):
        _lib.select_family(0)


def test_sm80_cannot_be_forced_on_turing(fake_gpu, monkeypatch):
    fake_gpu((7, 5), "Tesla T4", {"sm70": "7.5", "sm80": "8.0"})
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm80")
    with pytest.raises(RuntimeError, match="need compute capability 8.0"):
        _lib.select_family(0)


# ---- The registry's rule: which family computes a call (_families.takes, computing_family, _lib.call_family).

# A build's kernels as the rule reads them (_lib.compiled_kernels): sm90's forward at head dims 64 and 128 in fp16 and
# at 128 in bf16, its backward at 128 in fp16; sm80's forward and backward at every one of those.
KERNELS = frozenset(
    [("sm90", "fwd", "fp16", 64), ("sm90", "fwd", "fp16", 128), ("sm90", "fwd", "bf16", 128)]
    + [("sm90", "bwd", "fp16", 128)]
    + [("sm80", d, t, hd) for d in ("fwd", "bwd") for t in ("fp16", "bf16") for hd in (64, 128)]
)
PLAIN = Call("fwd", "fp16", 128)


@pytest.mark.parametrize(
    "call,family",
    [
        (PLAIN, "sm90"),
        (Call("fwd", "bf16", 128), "sm90"),
        (Call("fwd", "fp16", 64), "sm90"),
        (Call("bwd", "fp16", 128), "sm90"),
        (Call("bwd", "fp16", 128, deterministic=True), "sm90"),
        (Call("bwd", "fp16", 64), "sm80"),  # no sm90 backward kernel of that head dim in this build
        (Call("bwd", "fp16", 128, broadcast=True), "sm80"),
        (Call("fwd", "fp16", 128, varlen=True), "sm90"),
        (Call("bwd", "fp16", 128, varlen=True, deterministic=True), "sm90"),
        (Call("bwd", "fp16", 64, varlen=True), "sm80"),  # no sm90 backward kernel of that head dim in this build
        (Call("fwd", "fp16", 128, window=True), "sm90"),
        (Call("bwd", "fp16", 128, varlen=True, window=True, alibi=True, deterministic=True), "sm90"),
        (Call("fwd", "fp16", 128, alibi=True), "sm90"),
        (Call("fwd", "fp16", 128, varlen=True, softcap=True), "sm90"),
        (Call("bwd", "fp16", 128, window=True, softcap=True, alibi=True), "sm90"),
        (Call("fwd", "fp16", 128, dropout=True), "sm90"),
        (Call("bwd", "fp16", 128, alibi=True, softcap=True, dropout=True, deterministic=True), "sm90"),
        (Call("bwd", "fp16", 128, dropout=True, broadcast=True), "sm80"),
        (Call("fwd", "fp16", 128, cache=True), "sm90"),
        (Call("fwd", "bf16", 128, softcap=True, cache=True), "sm90"),
        (Call("fwd", "fp16", 128, varlen=True, cache=True), "sm90"),  # a paged cache of a varlen batch
        (
            Call("fwd", "fp16", 128, varlen=True, cache=True, broadcast=True),
            "sm80",
        ),  # an unpaged cache of a varlen batch
        (Call("fwd", "fp16", 128, broadcast=True), "sm80"),  # TMA takes no stride of 0
        (Call("fwd", "bf16", 64), "sm80"),  # no sm90 kernel of that dtype and head dim in this build
        (Call("fwd", "fp16", 256), "sm80"),
        (Call("fwd", "fp16", None), "sm80"),  # above the largest kernel head dim: sm80's error names it
        (Call("fwd", None, None, dropout=True), "sm80"),  # the dropout mask
    ],
)
def test_the_rule_sends_what_sm90_lacks_to_sm80(call, family):
    assert _families.computing_family("sm90", call, KERNELS) == family
    assert _families.takes(_families.get("sm90"), call, KERNELS) == (family == "sm90")


def test_auto_hands_on_what_sm90_computes_more_slowly():
    """The registry's `slower`: softcap with dropout in the sm90 backward up to head dim 64 goes to sm80, unless sm90
    was forced by name; either option alone, the forward, and larger head dims stay."""
    kernels = KERNELS | {("sm90", d, "fp16", 64) for d in ("fwd", "bwd")}
    call = Call("bwd", "fp16", 64, softcap=True, dropout=True)
    assert _families.computing_family("sm90", call, kernels) == "sm80"
    assert _families.computing_family("sm90", call, kernels, forced=True) == "sm90"
    for other in (
        Call("bwd", "fp16", 64, dropout=True),
        Call("bwd", "fp16", 64, softcap=True, window=True),
        Call("fwd", "fp16", 64, softcap=True, dropout=True),
        Call("bwd", "fp16", 128, softcap=True, dropout=True, alibi=True),
    ):
        assert _families.computing_family("sm90", other, kernels) == "sm90", other


def test_a_family_without_a_delegate_takes_every_call():
    for name in ("sm70", "sm75", "sm80"):
        assert _families.get(name).delegate is None
        for call in (
            PLAIN,
            Call("bwd", "bf16", 256, varlen=True, softcap=True, dropout=True, cache=True),
            Call("fwd", None, None),
        ):
            assert _families.computing_family(name, call, frozenset()) == name


def test_every_delegate_is_a_family_that_takes_every_call():
    for family in _families.FAMILIES:
        if family.delegate is not None:
            delegate = _families.get(family.delegate)
            assert delegate.delegate is None and set(family.directions) <= set(delegate.directions)
            assert delegate.serves(family.cc_min) and set(family.dtypes) <= set(delegate.dtypes)


def test_broadcast_operands_are_expanded_dimensions():
    x = torch.zeros(2, 3, 4, 8)
    assert not _ops._broadcast(x, x.transpose(1, 2), x[:1].expand(1, 3, 4, 8), x[:, :1])
    assert _ops._broadcast(x[:, :, :1].expand(2, 3, 4, 8)) and _ops._broadcast(x, x[:1].expand(2, 3, 4, 8))


def test_each_option_is_its_own_feature():
    for options in (_ops.NO_OPTIONS, _ops.Options(-1, -1, 0.0)):
        assert not any(_ops._option_features(options).values())
    for options, feature in (
        (_ops.Options(window_left=0), "window"),
        (_ops.Options(window_right=128), "window"),
        (_ops.Options(softcap=30.0), "softcap"),
        (_ops.Options(alibi_slopes=torch.ones(4)), "alibi"),
        (_ops.Options(dropout_p=0.1), "dropout"),
    ):
        used = {name for name, on in _ops._option_features(options).items() if on}
        assert used == {feature} and feature in _families.FEATURES, options


@pytest.fixture
def hopper_build(fake_gpu, monkeypatch):
    """An H200 whose build holds sm80 for 9.0 and sm90 for 9.0a (KERNELS); sm80's code runs only where runs_sm80."""

    def install(runs_sm80=True, families=None):
        runs = {"sm90", "sm80"} if runs_sm80 else {"sm90"}
        fake_gpu((9, 0), "NVIDIA H200", families or {"sm80": "9.0", "sm90": "9.0a"}, runs=runs)
        monkeypatch.setattr(_lib, "compiled_kernels", lambda: KERNELS)

    return install


def test_auto_never_takes_an_unreleased_family(hopper_build, monkeypatch):
    unreleased = tuple(dataclasses.replace(f, released=f.name != "sm90") for f in _families.FAMILIES)
    monkeypatch.setattr(_families, "FAMILIES", unreleased)
    hopper_build()
    assert _lib.select_family(0) == "sm80"
    assert _lib.call_family(0, PLAIN) == "sm80"


def test_forced_sm90_computes_its_calls_and_hands_the_others_to_sm80(hopper_build, monkeypatch):
    hopper_build()
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm90")
    assert _lib.select_family(0) == "sm90"
    assert _lib.call_family(0, PLAIN) == "sm90"
    assert _lib.call_family(0, Call("fwd", "fp16", 128, varlen=True)) == "sm90"
    for call in (
        Call("bwd", "fp16", 64),
        Call("fwd", "fp16", 128, cache=True, broadcast=True),
        Call("fwd", "fp16", 96),
    ):
        assert _lib.call_family(0, call) == "sm80"
    slower = Call("bwd", "fp16", 64, softcap=True, dropout=True)
    monkeypatch.setattr(_lib, "compiled_kernels", lambda: KERNELS | {("sm90", "bwd", "fp16", 64)})
    assert _lib.call_family(0, slower) == "sm90"  # (forced: it computes what it is slower at too)
    monkeypatch.setenv(_lib.BACKEND_ENV, "auto")
    assert _lib.call_family(0, slower) == "sm80"


def test_sm90_is_auto_on_hopper(hopper_build):
    hopper_build()
    assert _lib.call_family(0, PLAIN) == "sm90"
    assert _lib.call_family(0, Call("fwd", "fp16", 128, cache=True)) == "sm90"
    assert _lib.call_family(0, Call("fwd", "fp16", 128, cache=True, broadcast=True)) == "sm80"


def test_the_delegate_must_be_compiled_and_run_here(hopper_build, monkeypatch):
    hopper_build(families={"sm90": "9.0a"})
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm90")
    assert _lib.call_family(0, PLAIN) == "sm90"
    with pytest.raises(RuntimeError, match=r"no sm80 kernels.*TORCH_CUDA_ARCH_LIST='9\.0'"):
        _lib.call_family(0, Call("bwd", "fp16", 64))
    hopper_build(runs_sm80=False, families={"sm80": "8.0", "sm90": "9.0a"})
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm90")
    with pytest.raises(RuntimeError, match=r"sm80 kernels were compiled for 8\.0, which cannot run on NVIDIA H200"):
        _lib.call_family(0, Call("fwd", "fp16", 128, varlen=True, cache=True, broadcast=True))


def test_a_plan_keeps_its_family(hopper_build, monkeypatch):
    # (a plan's backward starts from the family of its forward, whatever CUTEFLASH_BACKEND says now)
    hopper_build()
    monkeypatch.setenv(_lib.BACKEND_ENV, "sm80")
    assert _lib.call_family(0, Call("bwd", "fp16", 128), "sm90") == "sm90"
    assert _lib.call_family(0, Call("bwd", "fp16", 128, deterministic=True), "sm90") == "sm90"
    assert _lib.call_family(0, Call("bwd", "fp16", 128, broadcast=True), "sm90") == "sm80"  # sm80's reads sm90's lse
    assert _lib.call_family(0, PLAIN, "sm90") == "sm90"
    assert _lib.call_family(0, PLAIN) == "sm80"


def test_a_family_limited_to_some_head_dims_has_only_those_kernels():
    # head_dims: a direction's kernels at some kernel head dims only (the others go to the delegate)
    limited = dataclasses.replace(_families.get("sm90"), head_dims={"bwd": (64,)})
    assert limited.has_kernel("bwd", 64) and not limited.has_kernel("bwd", 128) and limited.has_kernel("fwd", 128)
    assert not dataclasses.replace(limited, directions=("fwd",)).has_kernel("bwd", 64)
