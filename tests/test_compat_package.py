"""The flash-attn compatibility package (compat/) as a distribution: its wheel and metadata (name flash-attn, version
2.8.3+cuteflash<version>, requiring that cuteflash), pip installing it offline in build isolation, the refusal to
replace an official flash-attn, and an import that does not initialise CUDA."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cuteflash

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "compat"
pytestmark = pytest.mark.skipif(not (COMPAT / "build_backend.py").exists(), reason="needs the source tree")


@pytest.fixture(scope="module")
def backend():
    spec = importlib.util.spec_from_file_location("compat_build_backend", COMPAT / "build_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def isolated_backend(backend, monkeypatch):
    """The backend, seeing no installed package (so that what this environment holds decides nothing)."""
    monkeypatch.setattr(backend, "search_path", lambda: [])
    return backend


def expected_version() -> str:
    return f"2.8.3+cuteflash{cuteflash.__version__}"


def fake_distribution(site: Path, version: str, name: str = "flash_attn") -> None:
    """An installed flash-attn of this version in site, as pip leaves one (RECORD lists every file)."""
    dist_info = site / f"flash_attn-{version}.dist-info"
    package = site / "flash_attn"
    dist_info.mkdir(parents=True)
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = ["flash_attn/__init__.py,,", f"{dist_info.name}/METADATA,,", f"{dist_info.name}/RECORD,,"]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")


def pip(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_wheel_and_metadata(isolated_backend, tmp_path):
    name = isolated_backend.build_wheel(str(tmp_path))
    assert name == f"flash_attn-{expected_version()}-py3-none-any.whl"
    dist_info = f"flash_attn-{expected_version()}.dist-info"
    with zipfile.ZipFile(tmp_path / name) as wheel:
        files = {n: wheel.read(n) for n in wheel.namelist()}
    sources = {
        p.relative_to(COMPAT / "src").as_posix()
        for p in (COMPAT / "src" / "flash_attn").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert {"flash_attn/__init__.py", "flash_attn/flash_attn_interface.py", "flash_attn/bert_padding.py"} <= sources
    assert {"flash_attn/layers/__init__.py", "flash_attn/layers/rotary.py"} <= sources
    assert {"flash_attn/utils/distributed.py", "flash_attn/modules/mha.py"} <= sources
    sources.add("flash_attn_2_cuda.py")  # flash-attn's compiled module's name, a top-level module
    assert set(files) == sources | {f"{dist_info}/{n}" for n in ("METADATA", "WHEEL", "top_level.txt", "RECORD")}
    metadata = dict(line.split(": ", 1) for line in files[f"{dist_info}/METADATA"].decode().splitlines())
    assert metadata["Name"] == "flash-attn"
    assert metadata["Version"] == expected_version()
    assert metadata["Requires-Dist"] == f"cuteflash=={cuteflash.__version__.split('+')[0]}"
    assert files[f"{dist_info}/top_level.txt"].decode().split() == ["flash_attn", "flash_attn_2_cuda"]
    assert "Root-Is-Purelib: true" in files[f"{dist_info}/WHEEL"].decode()
    for line in files[f"{dist_info}/RECORD"].decode().splitlines():
        path, digest, size = line.split(",")
        if path == f"{dist_info}/RECORD":
            continue
        data = files[path]
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert int(size) == len(data)
    # The same sources give the same wheel.
    again = tmp_path / "again"
    isolated_backend.build_wheel(str(again))
    assert (again / name).read_bytes() == (tmp_path / name).read_bytes()


def test_version_is_one_transformers_accepts(backend, flash_attn_compat):
    version = pytest.importorskip("packaging.version")
    assert flash_attn_compat.__version__ == backend.version() == expected_version()
    parsed = version.parse(backend.version())
    assert parsed >= version.parse("2.3.3") and parsed >= version.parse("2.8.3")  # transformers' gates
    assert parsed.local.startswith("cuteflash")
    # A local label of cuteflash's own (a wheel's +cu130.sm80) joins this one, dot-separated.
    assert version.parse(backend._load_version_module().compat_version("0.2.0+cu130.sm80")).local == (
        "cuteflash0.2.0.cu130.sm80"
    )


def test_metadata_hook_writes_the_wheels_metadata(isolated_backend, tmp_path):
    name = isolated_backend.prepare_metadata_for_build_wheel(str(tmp_path))
    assert name == f"flash_attn-{expected_version()}.dist-info"
    assert (tmp_path / name / "METADATA").read_text() == isolated_backend.metadata()
    assert isolated_backend.get_requires_for_build_wheel() == []


def test_official_flash_attn_is_found(backend, tmp_path):
    official, compat, other = tmp_path / "official", tmp_path / "compat", tmp_path / "other"
    fake_distribution(official, "2.8.3", name="Flash-Attn")  # names compare normalised
    fake_distribution(compat, "2.8.3+cuteflash0.0.9")
    fake_distribution(other, "2.7.4.post1")
    assert backend.installed_official([str(compat)]) == []
    assert backend.installed_official([str(official)]) == [("2.8.3", str(official))]
    assert [v for v, _ in backend.installed_official([str(compat), str(other)])] == ["2.7.4.post1"]
    with pytest.raises(SystemExit, match=r"official flash-attn is installed \(flash-attn 2\.8\.3 in .*pip uninstall"):
        backend.refuse_to_replace_official([str(official)])
    backend.refuse_to_replace_official([str(compat)])


def test_pip_installs_it_offline_in_build_isolation(backend, tmp_path):
    if backend.installed_official():
        pytest.skip("an official flash-attn is installed here: the package refuses to build")
    target = tmp_path / "site"
    r = pip("install", "--no-index", "--no-deps", "--target", str(target), str(COMPAT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "flash_attn" / "flash_attn_interface.py").is_file()
    # transformers' test: the module flash_attn belongs to a distribution named flash-attn, of this version.
    probe = (
        "import importlib.metadata as m, sys; sys.path.insert(0, sys.argv[1]); "
        "print(m.packages_distributions().get('flash_attn'), m.version('flash-attn'))"
    )
    # -I -S: neither PYTHONPATH nor site-packages, so that only the target is seen (either may hold the package).
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, str(target)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["['flash-attn']", expected_version()]


def test_pip_refuses_to_replace_an_official_flash_attn(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    fake_distribution(site, "2.8.3")
    # pip --python installs into the venv, and its build isolation hides the venv's packages from sys.path: the
    # backend must find the official package all the same.
    r = pip("--python", str(python), "install", "--no-index", "--no-deps", str(COMPAT))
    if "no such option: --python" in r.stderr:
        pytest.skip("pip is older than 22.3 (no --python)")
    assert r.returncode != 0
    assert "the official flash-attn is installed (flash-attn 2.8.3 in" in r.stdout + r.stderr
    assert "pip uninstall flash-attn" in r.stdout + r.stderr
    assert [d.version for d in importlib.metadata.distributions(path=[str(site)])] == ["2.8.3"]

    # An earlier version of this package is replaced.
    pip("--python", str(python), "uninstall", "-y", "flash-attn").check_returncode()
    fake_distribution(site, "2.8.3+cuteflash0.0.9")
    r = pip("--python", str(python), "install", "--no-index", "--no-deps", str(COMPAT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert [d.version for d in importlib.metadata.distributions(path=[str(site)])] == [expected_version()]


def test_import_does_not_initialise_cuda(flash_attn_compat):
    """Importing every module of the package (in a fresh interpreter) leaves CUDA uninitialised."""
    code = (
        "import torch, flash_attn, flash_attn.flash_attn_interface, flash_attn.bert_padding, "
        "flash_attn.layers.rotary; print(flash_attn.__file__); print(torch.cuda.is_initialized())"
    )
    path = [str(Path(p)) for p in sys.path if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    file, initialised = r.stdout.split()
    assert Path(file) == Path(flash_attn_compat.__file__)
    assert initialised == "False"
