"""The benchmark's command line, outputs and no-GPU path (no GPU needed)."""

import csv
import json

import pytest
import torch

from cuteflash import bench


def test_defaults_and_flags():
    a = bench.parse_args([])
    assert (a.dtype, a.causal, a.forward_only, a.backend, a.layout, a.deterministic) == (
        None, None, False, "auto", "native", False)
    a = bench.parse_args(["--dtype", "bf16", "--no-causal", "--headdim", "64", "--headdim", "128", "--seqlen",
                          "4096", "--batch", "2", "--heads", "8", "--forward-only", "--backend", "sm80", "--json",
                          "x.json", "--csv", "x.csv", "--quick", "--layout", "bshd", "--deterministic"])
    assert a.dtype == ["bf16"] and a.causal is False and a.headdim == [64, 128] and a.seqlen == [4096]
    assert (a.batch, a.heads, a.forward_only, a.backend, a.json, a.csv, a.quick) == (2, 8, True, "sm80", "x.json",
                                                                                      "x.csv", True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "fp32"])


def test_default_suite_covers_dtypes_and_masks():
    cases = bench.build_cases(bench.parse_args([]), bf16_ok=True)
    assert {c.dtype for c in cases} == {"fp16", "bf16"} and {c.causal for c in cases} == {False, True}
    assert {(c.batch, c.heads, c.seqlen_q, c.head_dim) for c in cases} == set(bench.BASELINE_SHAPES)
    assert {c.dtype for c in bench.build_cases(bench.parse_args([]), bf16_ok=False)} == {"fp16"}


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
    causal = bench.Case(2, 4, 128, 256, 64, True, "fp16")
    assert causal.flops("fwd") == case.flops("fwd") / 2


def test_json_and_csv_outputs(tmp_path):
    r = bench.Result(bench.Case(1, 2, 64, 64, 64, True, "fp16"), correct=True, max_err=1e-3, pytorch_err=2e-3)
    r.ms = {"fwd": {"cuteflash": 1.0, "flash": 2.0, "cudnn": None, "efficient": 3.0}}
    r.tflops = {"fwd": {"cuteflash": 10.0, "flash": 5.0, "cudnn": None, "efficient": 3.3}}
    args = bench.parse_args(["--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")])
    bench.write_outputs([r], args, {"name": "GPU"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["device"] == {"name": "GPU"}
    assert data["results"][0]["case"]["head_dim"] == 64 and data["results"][0]["tflops"]["fwd"]["cuteflash"] == 10.0
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert rows[0]["cuteflash_fwd_tflops"] == "10.0" and rows[0]["cudnn_fwd_tflops"] == ""
    assert rows[0]["cuteflash_bwd_tflops"] == "" and rows[0]["correct"] == "True"
    table = bench.format_table([r])
    assert "forward TFLOP/s" in table and "2.00" in table and "backward" not in table


def test_no_gpu_exits_with_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
