"""Errors that name the problem: a kbit checkpoint whose config.json disagrees with its tensors, a float checkpoint
with NaN/Inf weights quantized on the fly, and a kbit folder loaded without `import kbit_hf`."""

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import kbit_hf
import kbit_hf.hub
from kbit_hf import KbitConfig
from kbit_hf.backends import reference
from tiny_models import rewritten_copy, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(family, k, absmax_format) -> a saved kbit folder of that tiny model."""
    cache = {}

    def get(family="llama", k=4, absmax_format="e4m4"):
        key = (family, k, absmax_format)
        if key not in cache:
            fp = tmp_path_factory.mktemp(family)
            tiny_model(family).save_pretrained(fp)
            model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=k,
                                                                                         absmax_format=absmax_format))
            out = tmp_path_factory.mktemp(f"{family}-k{k}-{absmax_format}")
            model.save_pretrained(out)
            cache[key] = str(out)
        return cache[key]

    return get


def _with_config(folder, tmp_path, **fields):
    """A copy of a kbit folder whose config.json's quantization_config has `fields` changed."""
    config = json.load(open(os.path.join(folder, "config.json")))
    config["quantization_config"].update(fields)
    d = tmp_path / "edited"
    d.mkdir()
    os.symlink(os.path.join(folder, "model.safetensors"), d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("config_k", [3, 5])
def test_config_k_that_disagrees_with_the_tensors_is_named(saved, tmp_path, config_k):
    folder = _with_config(saved(k=4), tmp_path, k=config_k)
    expected = (f"kbit checkpoint mismatch: config.json says k={config_k}, but model.layers.0.mlp.down_proj.weight has "
                "16 words per row of 100 inputs, which is k=4 (4 blocks x 4 words)")
    with pytest.raises(ValueError, match=re.escape(expected)):
        AutoModelForCausalLM.from_pretrained(folder)


def test_config_k_that_disagrees_with_fused_experts_is_named(saved, tmp_path):
    folder = _with_config(saved("qwen3_moe", k=4), tmp_path, k=3)
    expected = ("config.json says k=3, but model.layers.0.mlp.experts.down_proj has 8 words per row of 40 inputs, "
                "which is k=4 (2 blocks x 4 words)")
    with pytest.raises(ValueError, match=re.escape(expected)):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("stored, config, dtype", [("e4m4", "fp16", "U8"), ("fp16", "e4m4", "F16")])
def test_config_absmax_format_that_disagrees_with_the_tensors_is_named(saved, tmp_path, stored, config, dtype):
    folder = _with_config(saved(absmax_format=stored), tmp_path, absmax_format=config)
    expected = (f"kbit checkpoint mismatch: config.json says absmax_format={config!r}, but "
                f"model.layers.0.mlp.down_proj.weight_absmax is stored as {dtype}, which is absmax_format={stored!r}")
    with pytest.raises(ValueError, match=re.escape(expected)):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_codebook_of_the_wrong_length_is_named(saved, tmp_path):
    def halve_codebooks(state):
        for key in [k for k in state if k.endswith("_codebook")]:
            state[key] = state[key][::2].contiguous()

    folder = rewritten_copy(saved(k=4), tmp_path, "short-codebook", halve_codebooks)
    expected = ("kbit checkpoint mismatch: config.json says k=4 (a codebook of 16 values), but "
                "model.layers.0.mlp.down_proj.weight_codebook has shape [8], the length of a k=3 codebook")
    with pytest.raises(ValueError, match=re.escape(expected)):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_packed_width_that_is_no_k_is_named(saved, tmp_path):
    def widen(state):
        key = "model.layers.0.mlp.down_proj.weight"
        state[key] = torch.cat([state[key], state[key][:, :1]], dim=1)  # 17 words for 4 blocks

    folder = rewritten_copy(saved(k=4), tmp_path, "odd-width", widen)
    expected = "has 17 words per row of 100 inputs, which is no k in (2, 3, 4, 5)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        AutoModelForCausalLM.from_pretrained(folder)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _load_capturing_transformers_logs(*args, **kwargs):
    handler = _Records()
    logging.getLogger("transformers").addHandler(handler)
    try:
        with pytest.raises(ValueError) as info:
            AutoModelForCausalLM.from_pretrained(*args, **kwargs)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    return str(info.value), "\n".join(handler.lines)


def test_nan_weights_name_the_tensor_once(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
        model.model.layers[1].self_attn.q_proj.weight[0, :2] = float("inf")
    model.save_pretrained(tmp_path)
    message, logs = _load_capturing_transformers_logs(tmp_path, quantization_config=KbitConfig())
    assert message == ("kbit cannot quantize non-finite weights; the float checkpoint has NaN/Inf values in 2 "
                       "tensor(s): model.layers.1.mlp.down_proj.weight has 1 NaN and 0 Inf value(s) among 6400; "
                       "model.layers.1.self_attn.q_proj.weight has 0 NaN and 2 Inf value(s) among 4096")
    # transformers neither reports a conversion error nor repeats the tensor (no load report at all)
    assert "down_proj" not in logs and "NaN" not in logs and "LOAD REPORT" not in logs


def test_nan_in_one_expert_names_the_fused_tensor_and_the_expert(tmp_path):
    model = tiny_model("qwen3_moe")
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[2, 5, 7] = float("nan")
    model.save_pretrained(tmp_path)  # one tensor per expert on disk, fused again on load
    message, _ = _load_capturing_transformers_logs(tmp_path, quantization_config=KbitConfig())
    assert "model.layers.1.mlp.experts.gate_up_proj has 1 NaN and 0 Inf value(s) among 20480 (in expert(s) [2])" \
        in message


def test_after_a_nan_nothing_more_is_quantized(tmp_path, monkeypatch):
    model = tiny_model("llama")
    with torch.no_grad():  # the first quantized tensor the loader reaches (checkpoint keys are loaded sorted)
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    calls = []
    real_quantize = reference.quantize
    monkeypatch.setattr(reference, "quantize", lambda *a, **k: calls.append(1) or real_quantize(*a, **k))
    message, _ = _load_capturing_transformers_logs(tmp_path, quantization_config=KbitConfig())
    assert "model.layers.0.mlp.down_proj.weight has 1 NaN" in message
    assert calls == []


def test_loading_without_import_kbit_hf_fails_and_the_card_says_why(saved):
    """Nothing in a checkpoint can make transformers import kbit_hf (kbit_hf/hub.py says why): without the import the
    load must fail rather than return float garbage, and the model card must say what to do."""
    folder = saved()
    code = "\n".join([
        "import sys",
        "from transformers import AutoModelForCausalLM",
        "for kwargs in ({}, {'ignore_mismatched_sizes': True}):",
        "    try:",
        f"        AutoModelForCausalLM.from_pretrained({folder!r}, **kwargs)",
        "        print('loaded', kwargs)",
        "    except Exception as e:",
        "        print('failed', kwargs, type(e).__name__)",
        "assert 'kbit_hf' not in sys.modules",
    ])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["failed {} RuntimeError", "loaded {'ignore_mismatched_sizes': True}"]
    assert "Unknown quantization type, got kbit" in result.stderr
    card = open(os.path.join(folder, "README.md")).read()
    assert "import kbit_hf" in card and kbit_hf.hub.LOAD_NOTE in card
