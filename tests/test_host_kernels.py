"""Host-side checks of kernel code that need nvcc but no GPU (CI has nvcc): the GEMV's register codebook decode
against a direct lookup, and the limits the launch-shape rules of csrc/kbit_dispatch.h must respect
(tests/host/gemv_host_selftest.cu)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_gemv_register_decode_and_dispatch_rules(tmp_path):
    exe = tmp_path / "gemv_selftest"
    subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_80", f"-I{ROOT / 'csrc'}", "-o",
                    str(exe), str(ROOT / "tests/host/gemv_host_selftest.cu")], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decode_reg: 0 mismatches" in out.stdout and "dispatch: 0 failures" in out.stdout, out.stdout
