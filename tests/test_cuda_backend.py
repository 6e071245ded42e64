"""The CUDA backend's guards and rules, on the CPU (no GPU needed): without the compiled library every entry point
says so by name, with one it refuses tensors that are not on one CUDA device before any pointer reaches the library,
and the dispatch rules pick the tiled layout where they should."""

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import dispatch, library, tiled
from kbit_hf.backends.cuda import kernels as cb


def _calls():
    cbk = fmt.nf0_codebook(4)
    w = torch.randn(16, 256)
    p, a, s = reference.quantize(w, cbk, 4, "e4m4")
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    return {
        "quantize": lambda: cb.quantize(w, cbk, 4, "e4m4"),
        "dequantize": lambda: cb.dequantize(p, a, s, cbk, 4, 256),
        "linear": lambda: cb.linear(x, p, a, s, cbk, 4, 256),
        "linear_out": lambda: cb.linear_out(x, p, a, s, cbk, 4, 256, None, torch.empty(2, 16, dtype=x.dtype)),
        "expert_linear": lambda: cb.expert_linear(x, ids, p[None], a[None], s[None], cbk, 4, 256),
    }, (p, a)


def test_entry_points_without_the_library_name_the_problem(monkeypatch):
    monkeypatch.setattr(library, "lib", None)
    monkeypatch.setattr(library, "_load_error", "libkbit_cuda.so: not found")
    calls, (p, a) = _calls()
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"kbit CUDA {name}: the compiled CUDA library is not loaded "
                                               r"\(libkbit_cuda.so: not found\)"):
            call()
    # the layout conversions fall back to the reference
    assert all(torch.equal(u, v) for u, v in zip(tiled.tile(p, a, 256, 4), tiled.tile_reference(p, a, 256, 4)))


def test_entry_points_refuse_tensors_off_the_gpu(monkeypatch):
    monkeypatch.setattr(library, "lib", object())  # a library that must never be called with these tensors
    calls, _ = _calls()
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"kbit CUDA {name}: every tensor must be on one CUDA device; got cpu"):
            call()


@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_which_weights_kbit_linear_holds_tiled(monkeypatch, k):
    """The size threshold per K (dispatch.TILED_MIN_NUMEL) and the layout's own conditions, on a device that runs
    the tiled GEMV (here pretended: a library and an sm_90 device)."""
    monkeypatch.setattr(library, "lib", object())
    monkeypatch.setattr(dispatch, "tiled_gemv_runs_on", lambda index: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    held = {shape for shape in ((1024, 4096), (2048, 4096), (3072, 3072), (4096, 4096), (6144, 4096))
             if dispatch.holds_tiled(*shape, k, "e4m4", "cuda")}
    expected = {(6144, 4096)} | ({(4096, 4096)} if k != 2 else set())
    expected |= {(2048, 4096), (3072, 3072)} if k == 5 else set()
    assert held == expected
    assert not dispatch.holds_tiled(6144, 4096, k, "fp16", "cuda")  # the layout holds e4m4 scales only
    assert not dispatch.holds_tiled(6144 + 8, 4096, k, "e4m4", "cuda")  # out % 16
    assert not dispatch.holds_tiled(6144, 4096 + 128, k, "e4m4", "cuda")  # in % 256
    assert not dispatch.holds_tiled(6144, 4096, 6, "e4m4", "cuda")  # no tiled layout for other K


@pytest.mark.parametrize("gemm", (True, False), ids=("gemm_runs", "no_gemm"))
def test_which_expert_path_runs(monkeypatch, gemm):
    """dispatch.expert_linear_path on a pretended compute capability 9.0 device: the expert GEMV up to
    EXPERT_GEMM_MIN_ROWS rows per expert, the expert GEMM from there (fp16 / bf16, in % 64 == 0, E within the sort),
    dequantize + grouped_mm (bf16) where the GEMM does not run, the per-expert loop for fp32."""
    monkeypatch.setattr(dispatch, "wgmma_runs_on", lambda index: gemm)
    monkeypatch.setattr(dispatch, "grouped_mm_runs_on", lambda index: True)
    E, lo, hi = 128, dispatch.EXPERT_GEMM_MIN_ROWS, dispatch.EXPERT_GROUPED_MM_MIN_ROWS

    def path(rows_per_expert, dtype=torch.bfloat16, in_f=2048, e=E):
        return dispatch.expert_linear_path(rows_per_expert * e, e, 1536, in_f, dtype, 0)

    assert path(lo - 1) == "kernel" and path(lo - 1, torch.float16) == "kernel"
    assert path(lo) == ("gemm" if gemm else "kernel")
    assert path(lo, torch.float16) == ("gemm" if gemm else "kernel")
    assert path(hi) == ("gemm" if gemm else "grouped_mm")
    assert path(hi, torch.float16) == ("gemm" if gemm else "kernel")  # torch._grouped_mm here: bf16 only
    assert path(hi, in_f=2880) == ("gemm" if gemm else "grouped_mm")  # 2880 = 45 x 64: a last half group
    assert path(hi, in_f=2080) == "grouped_mm"  # not a multiple of 64
    assert path(hi, e=dispatch.EXPERT_GEMM_MAX_E + 1) == "grouped_mm"
    assert path(hi, torch.float32) == "loop"


def test_which_moe_blocks_run_fused():
    """dispatch.moe_fused: fp16 / bf16 blocks of one token, or of at most E / 4 rows (tokens x top-k), E / 2 from 64
    experts."""
    bf16 = torch.bfloat16
    assert dispatch.moe_fused(1, 2, 8, bf16) and not dispatch.moe_fused(2, 2, 8, bf16)  # Mixtral: 1 token
    assert dispatch.moe_fused(8, 8, 128, torch.float16) and not dispatch.moe_fused(9, 8, 128, bf16)  # Qwen3: 8 tokens
    assert dispatch.moe_fused(2, 4, 32, bf16) and not dispatch.moe_fused(3, 4, 32, bf16)  # gpt-oss-20b: 2 tokens
    assert dispatch.moe_fused(16, 2, 64, bf16) and not dispatch.moe_fused(8, 2, 63, bf16)  # E / 2 from 64 experts
    assert dispatch.moe_fused(1, 16, 8, bf16)  # one token's rows name distinct experts, however many
    assert not dispatch.moe_fused(0, 8, 128, bf16) and not dispatch.moe_fused(1, 2, 8, torch.float32)
