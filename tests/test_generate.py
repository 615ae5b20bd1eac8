"""The kernel generator (src/kernels/generate.py) and its agreement with the C++ tile table."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "src" / "kernels" / "generate.py"

pytestmark = pytest.mark.skipif(not GENERATOR.exists(), reason="needs the source tree")


def generate(tmp_path, *args):
    return subprocess.run([sys.executable, GENERATOR, "--out", tmp_path, *args], capture_output=True, text=True)


def test_one_file_per_instantiation(tmp_path):
    r = generate(tmp_path, "--families", "sm70", "sm80", "--headdims", "64", "128", "--dtypes", "fp16", "bf16")
    assert r.returncode == 0, r.stderr
    files = r.stdout.strip().split(";")
    assert sorted(files) == sorted(p.name for p in tmp_path.iterdir())
    kernels = sorted(f for f in files if f.startswith(("fwd_", "bwd_")))
    expected = [f"{d}_sm80_{t}_hd{h}.cu" for d in ("fwd", "bwd") for t in ("fp16", "bf16") for h in (64, 128)]
    expected += [f"{d}_sm70_fp16_hd{h}.cu" for d in ("fwd", "bwd") for h in (64, 128)]  # sm70: fp16 only
    assert kernels == sorted(expected)
    assert "probe_sm70.cu" in files and "probe_sm80.cu" in files
    source = (tmp_path / "fwd_sm80_bf16_hd128.cu").read_text()
    assert "sm80::run_fwd<cutlass::bfloat16_t, 128>" in source


def test_dispatch_switches_have_defaults(tmp_path):
    generate(tmp_path, "--families", "sm80", "--headdims", "64")
    dispatch = (tmp_path / "dispatch.cpp").read_text()
    assert "case 64: return &run_fwd_sm80_fp16_hd64;" in dispatch
    assert dispatch.count("switch (") == dispatch.count("default:")


@pytest.mark.parametrize("args", [["--headdims", "48"], ["--dtypes", "fp8"], ["--families", "sm60"]])
def test_unknown_values_are_rejected(tmp_path, args):
    r = generate(tmp_path, *args)
    assert r.returncode == 2 and "unknown" in r.stderr


def test_rerun_keeps_unchanged_files(tmp_path):
    generate(tmp_path, "--headdims", "64")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    generate(tmp_path, "--headdims", "64")
    assert before == {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}


def test_head_dims_come_from_the_common_tiles():
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        import generate as gen
    finally:
        sys.path.pop(0)
    assert gen.HEAD_DIMS == (32, 64, 96, 128, 160, 192, 224, 256)


def test_a_family_gets_the_kernels_of_its_directions_and_head_dims(tmp_path):
    # sm90: both directions at every head dim, and no decoding kernel of its own (decode_from)
    r = generate(tmp_path, "--families", "sm80", "sm90", "--headdims", "64", "128", "160", "--targets", "sm90=9.0a")
    assert r.returncode == 0, r.stderr
    files = r.stdout.strip().split(";")
    sm90 = sorted(f for f in files if "_sm90" in f)
    forward = [f"fwd_sm90_{t}_hd{h}.cu" for t in ("bf16", "fp16") for h in (128, 160, 64)]
    backward = [f"bwd_sm90_{t}_hd{h}.cu" for t in ("bf16", "fp16") for h in (128, 160, 64)]
    assert sm90 == sorted(forward + backward + ["probe_sm90.cu"])
    source = (tmp_path / "bwd_sm90_bf16_hd128.cu").read_text()
    assert '#include "cuteflash/sm90/bwd_launch.cuh"' in source
    assert "sm90::run_bwd<cutlass::bfloat16_t, 128>(p, stream);" in source
    dispatch = (tmp_path / "dispatch.cpp").read_text()
    find = dispatch.split("FwdFn find_decode(")[1].split("\n}\n")[0]
    assert "// sm80" in find and "sm90" not in find
    find = dispatch.split("BwdFn find_bwd(")[1].split("\n}\n")[0]
    assert "// sm90" in find and "case 160: return &run_bwd_sm90_fp16_hd160" in find
    assert "run_bwd_sm90_bf16_hd64" in find
    # sm80 (family 0) launches its own decoding kernel, and sm90 sm80's
    assert '{"sm80", "", sm80::FamilyTraits::kDecode, 0,' in dispatch
    assert '{"sm90", "9.0a", sm80::FamilyTraits::kDecode, 0,' in dispatch
    assert '{1, "bwd", DType::kFloat16, 64}' in dispatch and '{1, "bwd", DType::kFloat16, 160}' in dispatch
    assert dispatch.count('"bwd"') == 2 * (3 + 3)  # (sm80 and sm90 at 3 head dims; 2 dtypes)


def test_a_family_whose_decoding_kernel_is_not_compiled_in_says_so(tmp_path):
    r = generate(tmp_path, "--families", "sm90", "--headdims", "64", "--targets", "sm90=9.0a")
    assert r.returncode == 0, r.stderr
    assert not [f for f in r.stdout.strip().split(";") if f.startswith("decode_")]
    # decode_family -1: api.cpp's decoding_family raises rather than launch a kernel this build lacks
    assert '{"sm90", "9.0a", sm80::FamilyTraits::kDecode, -1,' in (tmp_path / "dispatch.cpp").read_text()
