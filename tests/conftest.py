"""GPU tests carry the `gpu` marker and are skipped, with the reason, where they cannot run."""

import pytest


def _gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    from cuteflash import _lib

    if _lib._C is None:
        return f"cuteflash's compiled module is not available: {_lib._C_ERROR}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
