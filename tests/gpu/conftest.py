"""GPU tests for the compiled kbit CUDA kernels: every test here is marked `cuda` and skipped cleanly when there is
no CUDA device or no compiled library (CPU-only CI)."""

import pytest
import torch


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
