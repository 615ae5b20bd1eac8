"""The benchmark's command line, outputs and no-GPU path (no GPU needed)."""

import csv
import json

import pytest
import torch

from cuteflash import bench


def test_defaults_and_flags():
    a = bench.parse_args([])
    assert (a.suite, a.dtype, a.causal, a.forward_only, a.backend, a.layout, a.deterministic, a.plot) == (
        "default",
        None,
        None,
        False,
        "auto",
        "native",
        False,
        None,
    )
    a = bench.parse_args(
        [
            "--dtype",
            "bf16",
            "--no-causal",
            "--headdim",
            "64",
            "--headdim",
            "128",
            "--seqlen",
            "4096",
            "--batch",
            "2",
            "--heads",
            "8",
            "--forward-only",
            "--backend",
            "sm80",
            "--json",
            "x.json",
            "--csv",
            "x.csv",
            "--quick",
            "--layout",
            "bshd",
            "--deterministic",
            "--plot",
            "x.png",
            "--suite",
            "baselines",
        ]
    )
    assert a.dtype == ["bf16"] and a.causal is False and a.headdim == [64, 128] and a.seqlen == [4096]
    assert (a.batch, a.heads, a.forward_only, a.backend, a.json, a.csv, a.quick, a.plot, a.suite) == (
        2,
        8,
        True,
        "sm80",
        "x.json",
        "x.csv",
        True,
        "x.png",
        "baselines",
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "fp32"])


def test_default_suite_covers_sizes_dtypes_and_masks():
    cases = bench.build_cases(bench.parse_args([]), bf16_ok=True)
    assert {c.dtype for c in cases} == {"fp16", "bf16"} and {c.causal for c in cases} == {False, True}
    shapes = {(c.batch, c.heads, c.seqlen_q, c.head_dim) for c in cases}
    assert shapes == set(bench.SUITES["default"])
    assert min(c.seqlen_q for c in cases) <= 16 and max(c.seqlen_q for c in cases) >= 4096
    assert {16, 64, 128, 256} <= {c.head_dim for c in cases}
    assert {c.dtype for c in bench.build_cases(bench.parse_args([]), bf16_ok=False)} == {"fp16"}
    baselines = bench.build_cases(bench.parse_args(["--suite", "baselines"]), bf16_ok=True)
    assert {(c.batch, c.heads, c.seqlen_q, c.head_dim) for c in baselines} == set(bench.SUITES["baselines"])
    # the latency table's shapes run beside the suite's, or alone
    assert not bench.build_cases(bench.parse_args(["--suite", "latency"]), bf16_ok=True)
    assert {backward for _, backward in bench.LATENCY_SHAPES} == {False, True}


def test_cases_limited_to_compiled_head_dims(monkeypatch):
    from cuteflash import _lib

    monkeypatch.setattr(_lib, "kernel_head_dims", lambda: (32, 64, 96, 128, 160, 192, 224, 256))
    cases = bench.build_cases(bench.parse_args([]), bf16_ok=True, head_dims_ok=[64, 128])
    assert {c.head_dim for c in cases} == {64, 128}  # 16 needs the 32 kernel, 256 the 256 one
    assert bench.kernel_head_dim(59, [64]) == 64 and bench.kernel_head_dim(40, [32, 64]) == 64
    assert bench.kernel_head_dim(16, [64]) is None


def test_chosen_shapes():
    cases = bench.build_cases(bench.parse_args(["--headdim", "96", "--seqlen", "512", "--causal"]), bf16_ok=True)
    assert all(c.head_dim == 96 and c.seqlen_q == c.seqlen_k == 512 and c.causal for c in cases)
    assert cases[0].batch == 32  # 16384 tokens per batch by default
    quick = bench.build_cases(bench.parse_args(["--quick"]), bf16_ok=True)
    assert {c.dtype for c in quick} == {"fp16"} and len(quick) == 2 * len(bench.QUICK_SHAPES)


def test_flop_counts():
    case = bench.Case(2, 4, 128, 256, 64, False, "fp16")
    assert case.flops("fwd") == 4 * 2 * 4 * 128 * 256 * 64
    assert case.flops("bwd") == 2.5 * case.flops("fwd")
    assert bench.Case(2, 4, 128, 256, 64, True, "fp16").flops("fwd") == case.flops("fwd") / 2


def fake_result():
    r = bench.Result(bench.Case(1, 2, 64, 64, 64, True, "fp16"), correct=True)
    r.max_err, r.pytorch_err = {"out": 1e-3}, {"out": 2e-3}
    r.peak_mib = {"cuteflash": 10.0, "math": 80.0}
    r.ms = {
        "fwd": {"cuteflash": 1.0, "flash": 2.0, "cudnn": None, "efficient": 3.0, "math": 8.0},
        "bwd": {"cuteflash": 2.0, "flash": 3.0, "cudnn": None, "efficient": 4.0, "math": 10.0},
    }
    r.tflops = {d: {n: (1.0 / t if t else None) for n, t in ms.items()} for d, ms in r.ms.items()}
    return r


def test_speedups_and_verdict():
    r = fake_result()
    assert r.speedup("fwd", "math") == 8.0 and r.speedup("fwd", "best") == 2.0
    assert r.speedup("total", "best") == 5.0 / 3.0 and r.speedup("bwd", "math") == 5.0
    assert r.best_backend() == "flash"
    v = bench.verdict([r])
    assert v.startswith("verdict: CORRECT") and "8x less memory" in v
    assert "1 INCORRECT" in bench.verdict([bench.Result(r.case, correct=False)])


def test_tables():
    rows = bench.summary_table([fake_result()])
    assert rows[1][1] == "ok" and rows[1][2] == "8.0" and rows[1][3] == "8.00x" and rows[1][-1] == "flash"
    text = bench.format_rows("t", bench.tflops_table([fake_result()]))
    assert "cuteflash" in text and "math" in text and text.count("\n") == 4


def test_json_and_csv_outputs(tmp_path):
    args = bench.parse_args(["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")])
    bench.write_outputs([fake_result()], args, {"name": "GPU"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["device"] == {"name": "GPU"}
    result = data["results"][0]
    assert result["case"]["head_dim"] == 64 and result["tflops"]["fwd"]["cuteflash"] == 1.0
    assert result["peak_mib"] == {"cuteflash": 10.0, "math": 80.0} and result["max_err"] == {"out": 1e-3}
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert rows[0]["cuteflash_fwd_tflops"] == "1.0" and rows[0]["cudnn_fwd_tflops"] == ""
    assert rows[0]["math_peak_mib"] == "80.0" and rows[0]["correct"] == "True"


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    bench.plot([fake_result()], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_no_gpu_exits_with_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_suite_on_the_gpu(tmp_path, capsys):
    assert bench.main(["--quick", "--repeats", "3", "--json", str(tmp_path / "r.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results and all(r["correct"] for r in results)
    assert all(r["tflops"]["fwd"]["cuteflash"] > 0 and r["tflops"]["bwd"]["cuteflash"] > 0 for r in results)
    out = capsys.readouterr().out
    assert "verdict: CORRECT" in out
    assert "Per-call latency" in out  # the quick run ends with the latency table


def test_peers_choose_the_backends_timed(capsys):
    case = bench.Case(1, 1, 16, 16, 16, False, "fp16")
    impls = bench._implementations(case, bench.parse_args(["--peers", "flash,efficient"]))
    assert list(impls) == ["cuteflash", "flash", "efficient"]
    assert list(bench._implementations(case, bench.parse_args([]))) == ["cuteflash", *bench.SDPA_BACKENDS]
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "flash,fastest"])  # refused before any GPU work
    assert "unknown backend(s) fastest" in capsys.readouterr().err


def fake_ring_result(dk_err=1e-3):
    weak = {"function": "zigzag_ring_flash_attn_func", "causal": True, "tokens": 8192}
    weak["ms"] = {"1": 2.0, "2": 4.2, "4": 8.0}
    strong = {
        "function": "ring_flash_attn_func",
        "causal": False,
        "tokens": 65536,
        "ms": {"1": 40.0, "2": 25.0, "4": 10.0},
    }
    long = {"tokens": 131072, "heads": 8, "head_dim": 128, "world": 4, "ms": 500.0, "peak_gib_per_gpu": 1.5}
    long.update({"shard_gib_per_gpu": 0.5, "total_gib_per_gpu": 80.0})
    long["math_backend_one_gpu"] = "CUDA out of memory. Tried to allocate 256.00 GiB"
    long["errors"] = {"out": [1e-3, 1e-3], "dk": [dk_err, 1e-3]}
    return {"world": 4, "weak": [weak], "strong": [strong], "long": long}


def test_ring_suite_tables_and_verdict():
    from cuteflash import bench_ring

    (_, weak), (_, strong), (long_title, long) = bench_ring.tables(fake_ring_result())
    assert weak[0][3:] == ["1 GPU ms", "2 GPUs ms (eff.)", "4 GPUs ms (eff.)"]
    assert weak[1][3:] == ["2.00", "4.20 (0.95)", "8.00 (1.00)"]  # efficiency: W x 2.0 / t_W
    assert strong[1][3:] == ["40.00", "25.00 (0.80)", "10.00 (1.00)"]  # efficiency: 40 / (W t_W)
    assert "256.00 GiB" in long_title and "5.2M tokens" in long_title  # 131072 x 80 / (1.5 + 0.5)
    assert [row[-1] for row in long[1:]] == ["ok", "ok"]
    assert long[1][3] == "PyTorch bf16" and long[2][3] == "flash_attn_func, 1 GPU"
    assert bench_ring.passed(fake_ring_result(dk_err=2.005e-3))  # within 2 x 1e-3 + 1e-5
    assert not bench_ring.passed(fake_ring_result(dk_err=2.02e-3))
    assert bench_ring.tables(fake_ring_result(dk_err=2.02e-3))[2][1][2][-1] == "FAILED"


def test_ring_suite_shards_and_needs(monkeypatch):
    from cuteflash import bench_ring

    assert bench_ring.zigzag_positions([16], 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert bench_ring.zigzag_positions([16], 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert bench_ring.zigzag_positions([8, 4], 1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    assert bench_ring.shard_positions([6, 4], 2, [1]).tolist() == [3, 4, 5, 8, 9]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench_ring.why_not() == "needs 2 GPUs, 1 visible"
    assert bench.parse_args(["--suite", "ring"]).suite == "ring"


def test_compare_pairs_each_rounds_samples():
    from cuteflash.bench_compare import paired_ratios

    # Round 2 ran with the GPU's clock 10 % slower for both builds: the pairing cancels it.
    median, q1, q3 = paired_ratios([1.0, 1.1, 1.0, 1.0], [1.01, 1.111, 1.01, 1.01])
    assert median == pytest.approx(1.01) and q1 == pytest.approx(1.01) and q3 == pytest.approx(1.01)
    assert paired_ratios([2.0], [1.0]) == (0.5, 0.5, 0.5)


def test_compare_refuses_what_it_cannot_load_or_run(tmp_path, capsys):
    from cuteflash import bench_compare

    with pytest.raises(SystemExit):
        bench_compare.main([str(tmp_path / "_C.so"), "--suites", "baselines,latency"])
    assert "unknown suites ['latency']" in capsys.readouterr().err
    (tmp_path / "_C.so").write_bytes(b"not a shared object")
    with pytest.raises(ImportError):
        bench_compare.load_module(str(tmp_path / "_C.so"))


def test_compare_gives_each_build_its_module_and_plans():
    """A planned call keeps the launch of the module that planned it: the comparison swaps the plans with the
    module, and leaves the installed build's in place when a call fails."""
    from cuteflash import _lib, interface
    from cuteflash.bench_compare import Comparison

    new_module, new_plans, old_module = _lib._C, interface._plans, object()
    c = Comparison.__new__(Comparison)
    c.lib, c.interface = _lib, interface
    c.modules = {"old": old_module, "new": new_module}
    c.plans = {"old": {}, "new": new_plans}
    try:
        c.use("old")
        assert _lib._C is old_module and interface._plans is c.plans["old"]
        c.use("new")
        assert _lib._C is new_module and interface._plans is new_plans

        def fails():
            assert _lib._C is old_module and interface._plans is c.plans["old"]  # the old build's first call
            raise RuntimeError("no kernel")

        with pytest.raises(RuntimeError, match="no kernel"):
            c.row("x", {"old": fails, "new": fails})
        assert _lib._C is new_module and interface._plans is new_plans
    finally:
        _lib._C, interface._plans = new_module, new_plans


def test_compare_runs_only_what_the_build_compiled():
    """A developer's build (CUTEFLASH_DTYPES, CUTEFLASH_HEADDIMS) holds a few kernels: the comparison times the
    rows of those (dtype, head dim) pairs of the family's forward kernels and names the others as skipped."""
    import torch

    from cuteflash.bench_compare import built_for

    def kernel(family, direction, dtype, head_dim):  # as build_info() lists them
        return {"family": family, "direction": direction, "dtype": dtype, "head_dim": head_dim}

    info = {
        "kernels": [
            kernel("sm80", "fwd", "float16", 64),
            kernel("sm80", "fwd", "bfloat16", 128),
            kernel("sm80", "bwd", "float16", 256),
            kernel("sm70", "fwd", "float16", 256),
        ]
    }
    assert built_for("sm80", info) == {(torch.float16, 64), (torch.bfloat16, 128)}
    assert built_for("sm70", info) == {(torch.float16, 256)}
    assert built_for("sm75", info) == set()  # not in this build
