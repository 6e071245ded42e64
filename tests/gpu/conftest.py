"""GPU tests for the compiled kbit CUDA kernels: every test here is marked `cuda` and skipped cleanly when there is
no CUDA device or no compiled library (CPU-only CI)."""

import os

import pytest
import torch

# Under pytest-xdist each worker takes its share of the host's cores: with torch's default, every core per worker,
# the workers' host work oversubscribes them (two processes of two threads on two cores quantized a weight 1.6-1.7x
# slower than with one thread each).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _why_skip():
    if not torch.cuda.is_available():
        return "no CUDA device"
    from kbit_hf.backends.cuda import library

    if not library.available():
        return f"kbit CUDA library not loaded ({library.load_error()})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.cuda)
        if not checked:
            reason, checked = _why_skip(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
