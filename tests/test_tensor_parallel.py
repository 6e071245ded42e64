"""Tensor parallelism over two processes (torchrun; gloo on the CPU, NCCL on two GPUs): kbit layers sharded by the
model's TP plan give the logits and greedy tokens of the unsharded model, and what cannot be sharded is refused with
an error that names the layer."""

import os
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tp(folder, tmp_path, k=None, gpus=False) -> dict:
    out = str(tmp_path / "tp_result.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", WORKER,
           str(folder), out] + ([str(k)] if k else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _dense(tmp_path, **overrides):
    # biases on every projection: a column-wise shard splits its bias, a row-wise one adds it once after the sum
    model = tiny_model("llama", dtype=torch.float32, **{"intermediate_size": 128, "attention_bias": True,
                                                        "mlp_bias": True, **overrides})
    model.save_pretrained(tmp_path / "fp")
    return tmp_path / "fp"


@pytest.mark.parametrize("gpus", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))], ids=["cpu", "two_gpus"])
def test_tensor_parallel_matches_one_process(tmp_path, gpus):
    fp = _dense(tmp_path, **(dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=8192) if gpus else {}))
    device = "cuda:0" if gpus else "cpu"
    one = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), dtype=torch.float32,
                                               device_map=device)
    one.save_pretrained(tmp_path / "q")
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % one.config.vocab_size
    with torch.no_grad():
        ref = one(ids.to(device)).logits.float().cpu()
        ref_tokens = one.generate(ids.to(device), max_new_tokens=6, do_sample=False).cpu()
    for source, k in ((fp, 4), (tmp_path / "q", None)):  # on the fly, then pre-quantized
        got = run_tp(source, tmp_path, k, gpus)
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(got["logits"], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert torch.equal(got["tokens"], ref_tokens), source
        out, inp = one.config.hidden_size, one.config.intermediate_size
        assert got["widths"]["model.layers.0.self_attn.q_proj"][:4] == (out // 2, out, out, out)
        assert got["widths"]["model.layers.0.mlp.down_proj"][:4] == (out, inp // 2, out, inp)
        if gpus:  # the shards are held in the tiled layout where it applies
            assert got["widths"]["model.layers.0.mlp.down_proj"][4] != "bit planes"
        assert "tensor-parallel shard" in got["save_error"] and "tp_plan" in got["save_error"]


def test_tensor_parallel_refuses_a_row_split_inside_a_block(tmp_path):
    # down_proj's 100 inputs (4 blocks, the last padded) cannot split into two halves of whole blocks
    fp = _dense(tmp_path, intermediate_size=100)
    got = run_tp(fp, tmp_path, k=4)
    assert "model.layers.0.mlp.down_proj" in got["error"] and "in_features=100" in got["error"], got["error"]
    assert "multiple of 64" in got["error"]


def test_tensor_parallel_refuses_moe_experts(tmp_path):
    tiny_model("qwen3_moe", dtype=torch.float32).save_pretrained(tmp_path / "fp")
    got = run_tp(tmp_path / "fp", tmp_path, k=4)
    assert "NotImplementedError" in got["error"] and "mlp.experts" in got["error"], got["error"]
