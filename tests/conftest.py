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


@pytest.fixture(autouse=True)
def _seed_from_node_id(request):
    """Seeds torch's global generators (CPU and CUDA) from the test's node id, so that the random inputs of
    a failing test are drawn again when it is rerun. CUTEFLASH_TEST_SEED (an integer) shifts every seed:
    other draws for the same tests."""
    try:
        import torch
    except ImportError:
        yield
        return
    import os
    import zlib

    seed = (zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("CUTEFLASH_TEST_SEED", "0"))) % 2**31
    torch.manual_seed(seed)  # also seeds every CUDA device's generator (lazily where CUDA is not initialized)
    yield
