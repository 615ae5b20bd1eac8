"""The PEP 517 build backend of the flash-attn compatibility package (compat/pyproject.toml names it).

It writes the wheel itself with the standard library, so `pip install ./compat` needs no build dependency: it works
offline, with or without build isolation. Before it writes metadata or a wheel it refuses to go on where an
official flash-attn (a version without "+cuteflash") is installed in the environment pip installs into, since
installing this distribution, also named flash-attn, would uninstall it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import re
import site
import sys
import sysconfig
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "flash_attn"
CUTEFLASH_VERSION_FILE = HERE.parent / "python" / "cuteflash" / "_version.py"
NAME = "flash-attn"
SUMMARY = "flash-attn 2.8's Python API on cuteflash's FlashAttention kernels, for NVIDIA GPUs from Volta to Hopper"
REPLACE_HELP = (
    "Installing cuteflash's compatibility package, which is also named flash-attn, would uninstall it. Use another "
    "environment, or uninstall it first (pip uninstall flash-attn) if replacing it is what you want."
)
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same sources give the same wheel


def _load_version_module():
    spec = importlib.util.spec_from_file_location("_flash_attn_compat_version", PACKAGE / "_version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuteflash_version() -> str:
    """The version of the cuteflash this package is built with (the repository's python/cuteflash/_version.py)."""
    if not CUTEFLASH_VERSION_FILE.is_file():
        raise SystemExit(
            f"error: {CUTEFLASH_VERSION_FILE} not found: build compat/ inside the cuteflash repository (pip 21.3 and "
            "newer build a local folder in place)"
        )
    match = re.search(r'^__version__ = "([^"]+)"', CUTEFLASH_VERSION_FILE.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"no __version__ in {CUTEFLASH_VERSION_FILE}")
    return match.group(1)


def version() -> str:
    return _load_version_module().compat_version(cuteflash_version())


def metadata() -> str:
    """The core metadata: flash-attn, needing exactly the cuteflash it was built with, whose internals it calls."""
    requirement = f"cuteflash=={_load_version_module().public(cuteflash_version())}"
    return (
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version()}\nSummary: {SUMMARY}\n"
        f"License: BSD-3-Clause\nRequires-Python: >=3.9\nRequires-Dist: {requirement}\n"
    )


def search_path() -> list[str]:
    """Where the environment that pip installs into keeps its packages: sys.path, and, because build isolation
    hides them from sys.path (but not sys.prefix), the interpreter's site-packages and, outside a virtual
    environment, the user's (which build isolation turns off but the installed package would see)."""
    paths = list(sys.path)
    for key in ("purelib", "platlib"):
        paths.append(sysconfig.get_paths()[key])
    if sys.prefix == sys.base_prefix:
        paths.append(site.getusersitepackages())
    return list(dict.fromkeys(p for p in paths if p and os.path.isdir(p)))


def installed_official(paths: list[str] | None = None) -> list[tuple[str, str]]:
    """(version, location) of each installed flash-attn that is not this package."""
    is_compat = _load_version_module().is_compat
    found = {}
    for dist in importlib.metadata.distributions(path=search_path() if paths is None else paths):
        name = re.sub(r"[-_.]+", "-", dist.metadata.get("Name") or "").lower()
        if name == NAME and not is_compat(dist.version):
            found.setdefault((dist.version, str(dist.locate_file(""))), None)
    return list(found)


def refuse_to_replace_official(paths: list[str] | None = None) -> None:
    official = installed_official(paths)
    if official:
        where = "; ".join(f"flash-attn {v} in {loc}" for v, loc in official)
        # SystemExit rather than an exception: pip shows the message alone, without a traceback.
        raise SystemExit(f"error: the official flash-attn is installed ({where}). {REPLACE_HELP}")


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _dist_info_files() -> dict[str, bytes]:
    return {
        "METADATA": metadata().encode(),
        "WHEEL": b"Wheel-Version: 1.0\nGenerator: cuteflash-compat\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "top_level.txt": b"flash_attn\nflash_attn_2_cuda\n",
    }


def _dist_info_name() -> str:
    return f"flash_attn-{version()}.dist-info"


def _package_files() -> dict[str, bytes]:
    """flash_attn's sources and the top-level module flash_attn_2_cuda, by their path in the wheel."""
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    files.append(PACKAGE.parent / "flash_attn_2_cuda.py")
    return {p.relative_to(PACKAGE.parent).as_posix(): p.read_bytes() for p in files}


# ---- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    refuse_to_replace_official()
    return write_metadata(metadata_directory, _dist_info_name(), _dist_info_files())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    refuse_to_replace_official()
    wheel_name = f"flash_attn-{version()}-py3-none-any.whl"
    return write_wheel(wheel_directory, wheel_name, _dist_info_name(), _package_files(), _dist_info_files())


def write_metadata(metadata_directory, dist_info: str, dist_info_files: dict) -> str:
    """Writes dist_info_files into metadata_directory/dist_info (prepare_metadata_for_build_wheel); returns
    dist_info. Also compat3/build_backend.py's."""
    folder = Path(metadata_directory) / dist_info
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in dist_info_files.items():
        (folder / name).write_bytes(data)
    return dist_info


def write_wheel(wheel_directory, wheel_name: str, dist_info: str, files: dict, dist_info_files: dict) -> str:
    """Writes a pure-Python wheel: `files` by their path in it, `dist_info_files` under dist_info/, and the RECORD
    of them all; fixed timestamps. Also compat3/build_backend.py's."""
    contents = dict(files)
    contents.update({f"{dist_info}/{name}": data for name, data in dist_info_files.items()})
    record = [_record_line(path, data) for path, data in contents.items()] + [f"{dist_info}/RECORD,,"]
    contents[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in contents.items():
            info = zipfile.ZipInfo(path, _ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    Path(wheel_directory).mkdir(parents=True, exist_ok=True)
    (Path(wheel_directory) / wheel_name).write_bytes(buffer.getvalue())
    return wheel_name
