"""The PEP 517 build backend of FA3's interface (compat3/pyproject.toml names it): the wheel of the distribution
flash_attn_3, version 3.0.0+cuteflash<version>, requiring that cuteflash, written with the standard library as
compat/build_backend.py writes flash-attn's (whose helpers it loads by path). It refuses to go on where an
official FA3 (a version without "+cuteflash") is installed in the environment pip installs into."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
NAME = "flash_attn_3"  # FA3's distribution name (pip shows flash-attn-3)
API_VERSION = "3.0.0"  # FA3's hopper/__init__.py
SUMMARY = "FlashAttention-3's Python interface on cuteflash's kernels, for NVIDIA GPUs from Volta to Hopper"


def _compat_backend():
    spec = importlib.util.spec_from_file_location(
        "_cuteflash_compat_backend", HERE.parent / "compat" / "build_backend.py"
    )
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise SystemExit("error: compat/build_backend.py not found: build compat3/ inside the cuteflash repository")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _compat_backend()


def version() -> str:
    label = re.sub(r"[^A-Za-z0-9]+", ".", _shared.cuteflash_version()).strip(".")
    return f"{API_VERSION}+cuteflash{label}"


def metadata() -> str:
    requirement = f"cuteflash=={_shared.cuteflash_version().split('+', 1)[0]}"
    return (
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version()}\nSummary: {SUMMARY}\n"
        f"License: BSD-3-Clause\nRequires-Python: >=3.9\nRequires-Dist: {requirement}\n"
    )


def installed_official(paths: list[str] | None = None) -> list[tuple[str, str]]:
    """(version, location) of each installed FA3 that is not this package."""
    found = {}
    for dist in importlib.metadata.distributions(path=_shared.search_path() if paths is None else paths):
        name = re.sub(r"[-_.]+", "-", dist.metadata.get("Name") or "").lower()
        if name == "flash-attn-3" and "+cuteflash" not in dist.version:
            found.setdefault((dist.version, str(dist.locate_file(""))), None)
    return list(found)


def refuse_to_replace_official(paths: list[str] | None = None) -> None:
    official = installed_official(paths)
    if official:
        where = "; ".join(f"flash-attn-3 {v} in {loc}" for v, loc in official)
        raise SystemExit(
            f"error: the official FlashAttention-3 is installed ({where}). Installing cuteflash's FA3 interface, also "
            "named flash_attn_3, would uninstall it. Use another environment, or uninstall it first (pip uninstall "
            "flash_attn_3) if replacing it is what you want."
        )


def _dist_info_name() -> str:
    return f"{NAME}-{version()}.dist-info"


def _dist_info_files() -> dict[str, bytes]:
    return {
        "METADATA": metadata().encode(),
        "WHEEL": b"Wheel-Version: 1.0\nGenerator: cuteflash-compat3\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "top_level.txt": b"flash_attn_3\nflash_attn_interface\n",
    }


def _package_files() -> dict[str, bytes]:
    files = sorted(p for p in SOURCES.rglob("*.py") if "__pycache__" not in p.parts)
    return {p.relative_to(SOURCES).as_posix(): p.read_bytes() for p in files}


# ---- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    refuse_to_replace_official()
    return _shared.write_metadata(metadata_directory, _dist_info_name(), _dist_info_files())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    refuse_to_replace_official()
    wheel_name = f"{NAME}-{version()}-py3-none-any.whl"
    return _shared.write_wheel(wheel_directory, wheel_name, _dist_info_name(), _package_files(), _dist_info_files())
