"""The mask policy (include/cuteflash/mask.h), which every kernel asks for its block ranges and per-row
limits, checked exhaustively over small sizes against a brute-force mask: a host C++ program, built here."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mask_policy_matches_brute_force(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path / "mask_policy_check"
    source = Path(__file__).with_name("mask_policy_check.cpp")
    subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{ROOT / 'include'}", str(source), "-o", str(exe)], check=True
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok "), run.stdout
