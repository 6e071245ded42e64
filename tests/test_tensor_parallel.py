"""Tensor parallelism over two processes (torchrun; gloo on the CPU, NCCL on two GPUs): kbit layers sharded by the
model's TP plan give the logits and greedy tokens of the unsharded model, and what cannot be sharded is refused with
an error that names the layer."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from kbit_hf import KbitConfig

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tp(folder, tmp_path, k=None, gpus=False, plan=None) -> dict:
    out = str(tmp_path / "tp_result.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU
    extra = [str(k or 0)] if k or plan else []
    if plan:
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        extra.append(str(tmp_path / "plan.json"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", WORKER,
           str(folder), out] + extra
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _tiny(tmp_path, family, **overrides):
    # llama: biases on every projection (a column-wise shard splits its bias, a row-wise one adds it once after the
    # sum); the MoE families: experts whose down_proj inputs split into whole blocks
    base = {"llama": dict(intermediate_size=128, attention_bias=True, mlp_bias=True),
            "qwen3_moe": dict(moe_intermediate_size=64), "mixtral": dict(intermediate_size=128)}[family]
    tiny_model(family, dtype=torch.float32, **{**base, **overrides}).save_pretrained(tmp_path / "fp")
    return tmp_path / "fp"


WIDE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("family,gpus", [("llama", False), ("qwen3_moe", False), ("mixtral", False),
                                         pytest.param("llama", True, marks=TWO_GPUS),
                                         pytest.param("qwen3_moe", True, marks=TWO_GPUS)])
def test_tensor_parallel_matches_one_process(tmp_path, family, gpus):
    """On the fly and pre-quantized: the unsharded model's logits and greedy tokens, each layer holding its shard."""
    fp = _tiny(tmp_path, family, **(WIDE if gpus and family == "llama" else {}))
    device = "cuda:0" if gpus else "cpu"
    one = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), dtype=torch.float32,
                                               device_map=device)
    one.save_pretrained(tmp_path / "q")
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % one.config.vocab_size
    with torch.no_grad():
        ref = one(ids.to(device)).logits.float().cpu()
        ref_tokens = one.generate(ids.to(device), max_new_tokens=6, do_sample=False).cpu()
    hidden = one.config.hidden_size
    for source, k in ((fp, 4), (tmp_path / "q", None)):  # on the fly, then pre-quantized
        got = run_tp(source, tmp_path, k, gpus)
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(got["logits"], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert torch.equal(got["tokens"], ref_tokens), source
        widths = got["widths"]
        assert widths["model.layers.0.self_attn.q_proj"][:4] == (hidden // 2, hidden, hidden, hidden)
        if family == "llama":
            inter = one.config.intermediate_size
            assert widths["model.layers.0.mlp.down_proj"][:4] == (hidden, inter // 2, hidden, inter)
            if gpus:  # a 4096 x 4096 shard is held in the tiled layout
                assert widths["model.layers.0.mlp.gate_proj"][4] != "bit planes"
        else:
            inter = one.model.layers[0].mlp.experts.down_proj_absmax.shape[-1] * 32
            assert widths["model.layers.0.mlp.experts"] == ({"gate_up_proj": hidden, "down_proj": inter // 2},
                                                            inter)  # gate_up: half of each of gate and up
        assert "tensor-parallel shard" in got["save_error"] and "tp_plan" in got["save_error"]


@pytest.mark.parametrize("family,overrides,names", [
    ("llama", dict(intermediate_size=100), ["model.layers.0.mlp.down_proj", "in_features=100", "multiple of 64"]),
    ("qwen3_moe", dict(moe_intermediate_size=40), ["model.layers.0.mlp.experts.down_proj", "in_features=40"]),
])
def test_tensor_parallel_refuses_what_it_cannot_shard(tmp_path, family, overrides, names):
    """A row-wise split inside a 32-weight block (100 or 40 inputs over two processes): an error that names the
    layer."""
    tiny_model(family, dtype=torch.float32, **overrides).save_pretrained(tmp_path / "fp")
    got = run_tp(tmp_path / "fp", tmp_path, k=4)
    assert "error" in got, "the load should have failed"
    for name in names:
        assert name in got["error"], got["error"]


def test_tensor_parallel_with_a_tp_plan_dict(tmp_path):
    """A user's tp_plan dict, merged by transformers over the model's plan after the quantizer's hooks (>= 5.23):
    the unsharded model's logits. Before 5.23 the dict replaces the plan wholesale, and kbit refuses it."""
    fp = _tiny(tmp_path, "llama")
    one = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), dtype=torch.float32,
                                               device_map="cpu")
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % one.config.vocab_size
    with torch.no_grad():
        ref = one(ids).logits.float()
    plan = {f"model.layers.*.{m}": style for m, style in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise"))}
    got = run_tp(fp, tmp_path, k=4, plan=plan)
    if not hasattr(PreTrainedModel, "_resolve_parallel_plans"):  # < 5.23: the dict replaces the model's plan
        assert "tp_plan='auto'" in got.get("error", ""), got.get("error")
        return
    assert "error" not in got, got.get("error")
    torch.testing.assert_close(got["logits"], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert got["widths"]["model.layers.0.mlp.down_proj"][:2] == (one.config.hidden_size,
                                                                 one.config.intermediate_size // 2)


def _planned(tmp_path, family, rules, **overrides):
    """prepare_plan run on a loaded kbit model given the TP plan `rules` (no processes needed: it edits the plan)."""
    from kbit_hf import tensor_parallel

    fp = _tiny(tmp_path, family, **overrides)
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), dtype=torch.float32,
                                                 device_map="cpu")
    model.tp_plan = dict(rules)
    tensor_parallel.prepare_plan(model, 2)
    return model.tp_plan


def test_prepare_plan_entries(tmp_path):
    plan = _planned(tmp_path, "llama", {"model.layers.*.self_attn.q_proj": "colwise",
                                        "model.layers.*.mlp.down_proj": "rowwise",
                                        "model.layers.*.self_attn.k_proj": "mla_kv_a_proj"})
    q, down = "model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj"
    assert plan[q + ".weight_absmax"] == "colwise" and plan[down + ".weight_absmax"] == "rowwise"
    assert plan[q + ".weight_scale"] == plan[q + ".weight_codebook"] == "replicate"
    # a style that leaves the weight whole needs no entries
    assert not any(key.startswith("model.layers.*.self_attn.k_proj.") for key in plan)


@pytest.mark.parametrize("rules,message", [
    ({"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise", "model.layers.*.mlp.experts.down_proj": "rowwise"},
     "without the experts hook"),
    ({"model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.mlp.experts.gate_up_proj": "colwise",
      "model.layers.*.mlp.experts.down_proj": "rowwise"}, "gate and up halves"),
    ({"model.layers.*.mlp.experts": "moe_tp_experts",
      "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"}, "no rule for model.layers.0.mlp.experts.down_proj"),
])
def test_prepare_plan_refuses_expert_plans_that_would_compute_wrong_results(tmp_path, rules, message):
    with pytest.raises(NotImplementedError, match=message) as e:
        _planned(tmp_path, "qwen3_moe", rules)
    assert "modules_to_not_convert" in str(e.value)
