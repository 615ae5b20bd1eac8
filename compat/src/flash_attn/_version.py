"""The version of this flash-attn distribution: the flash-attn release whose API it provides, with cuteflash's
version as the local label (2.8.3+cuteflash0.1.0). The build backend (compat/build_backend.py) loads this file
by its path, so it imports nothing but the standard library."""

import re

API_VERSION = "2.8.3"  # the flash-attn release whose functions, signatures and custom ops this package provides
LOCAL_PREFIX = "cuteflash"  # an installed flash-attn whose version lacks "+cuteflash" is the official package


def public(version: str) -> str:
    """A version without its local label: 0.1.0+cu130.sm80 -> 0.1.0."""
    return version.split("+", 1)[0]


def compat_version(cuteflash_version: str) -> str:
    """This package's version for a cuteflash version; a local label of cuteflash's is kept, dot-separated, since
    a version has one '+' at most."""
    label = re.sub(r"[^A-Za-z0-9]+", ".", cuteflash_version).strip(".")
    return f"{API_VERSION}+{LOCAL_PREFIX}{label}"


def is_compat(version: str) -> bool:
    """Whether an installed flash-attn of this version is this package (of any cuteflash version)."""
    return "+" in version and version.split("+", 1)[1].startswith(LOCAL_PREFIX)
