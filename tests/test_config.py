"""KbitConfig: defaults, JSON round trip through config.json, and clear errors naming the field."""

import json

import pytest
from transformers import AutoConfig
from transformers.quantizers import auto

import kbit_hf
from kbit_hf import KbitConfig


def test_defaults():
    c = KbitConfig()
    assert (c.k, c.codebook, c.absmax_format, c.modules_to_not_convert, c.quantize_lm_head, c.dequantize) == (
        4, "nf0", "e4m4", None, False, False)
    assert c.quant_method == "kbit" and c.bits_per_weight == 4.25


def test_dict_and_json_round_trip():
    c = KbitConfig(k=3, codebook=[-1, -0.5, -0.2, -0.05, 0.05, 0.2, 0.5, 1], absmax_format="fp16",
                   modules_to_not_convert=["q_proj"], quantize_lm_head=True)
    d = json.loads(c.to_json_string())
    assert d["quant_method"] == "kbit" and d["k"] == 3 and d["absmax_format"] == "fp16" and d["quantize_lm_head"]
    again = KbitConfig.from_dict(d)
    assert again == c and again.codebook == [-1.0, -0.5, -0.2, -0.05, 0.05, 0.2, 0.5, 1.0]


def test_registered_and_resolved_from_config_json(tmp_path):
    assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["kbit"] is KbitConfig
    assert auto.AUTO_QUANTIZER_MAPPING["kbit"] is kbit_hf.KbitHfQuantizer
    from tiny_models import tiny_config

    cfg = tiny_config("llama")
    cfg.quantization_config = KbitConfig(k=5).to_dict()
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["quantization_config"]["k"] == 5
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert auto.AutoQuantizationConfig.from_dict(loaded.quantization_config) == KbitConfig(k=5)


def test_register_is_idempotent():
    kbit_hf.register()
    kbit_hf.register()
    assert sum(t is KbitConfig for t in auto.LOADING_ATTRIBUTES_CONFIG_TYPES) == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(k=6), "k"),
        (dict(k=1), "k"),
        (dict(k="4"), "k"),
        (dict(k=True), "k"),
        (dict(codebook="nf5"), "codebook"),
        (dict(k=2, codebook=[-1, 0, 1]), "codebook"),
        (dict(k=2, codebook=[-1, 0.5, 0.2, 1]), "codebook"),
        (dict(k=2, codebook=[-1, -0.2, -0.2, 1]), "codebook"),
        (dict(k=2, codebook=[-1, 0.5, 0.5 + 1e-12, 1]), "codebook"),  # distinct in float64, equal in float32
        (dict(k=2, codebook=[-1, float("nan"), 0.2, 1]), "codebook"),
        (dict(k=2, codebook=[-1, -0.2, 0.2, float("inf")]), "codebook"),
        (dict(k=2, codebook=[-2, -0.2, 0.2, 1]), "codebook"),
        (dict(codebook=3), "codebook"),
        (dict(absmax_format="fp8"), "absmax_format"),
        (dict(modules_to_not_convert=[""]), "modules_to_not_convert"),
        (dict(quantize_lm_head=1), "quantize_lm_head"),
        (dict(dequantize="yes"), "dequantize"),
        (dict(format_version=99), "format_version"),
        (dict(bits=4), "unknown field"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KbitConfig(**kwargs)


def test_modules_to_not_convert_must_be_a_list():
    # list("q_proj") would be its characters, and q_proj would be quantized after all
    with pytest.raises(ValueError, match=r"did you mean \['q_proj'\]"):
        KbitConfig(modules_to_not_convert="q_proj")


def test_update_validates_and_leaves_an_invalid_update_undone():
    cfg = KbitConfig(k=4, modules_to_not_convert=["lm_head"])
    assert cfg.update(k=3, unknown=1) == {"unknown": 1} and cfg.k == 3
    cfg.update(k=2, codebook=(-1.0, -0.25, 0.25, 1.0))  # a tuple, as the constructor takes it
    assert cfg.codebook == [-1.0, -0.25, 0.25, 1.0]
    cfg.update(k=3, codebook="nf0")
    with pytest.raises(ValueError, match="k: must be one of"):
        cfg.update(k=7)
    with pytest.raises(ValueError, match="dequantize"):
        cfg.update(dequantize="yes")
    assert cfg.k == 3 and cfg.dequantize is False and cfg.codebook_tensor().numel() == 8


def test_to_dict_is_a_copy():
    cfg = KbitConfig(modules_to_not_convert=["q_proj"])
    cfg.to_dict()["modules_to_not_convert"].append("k_proj")
    assert cfg.modules_to_not_convert == ["q_proj"]


def test_module_k_picks_the_most_specific_pattern_and_round_trips():
    cfg = KbitConfig(k=3, module_k={"down_proj": 5, "self_attn": 5, "model.layers.0.self_attn": 4})
    assert cfg.k_for("model.layers.1.mlp.down_proj") == 5
    assert cfg.k_for("model.layers.0.self_attn.q_proj") == 4  # more components than "self_attn"
    assert cfg.k_for("model.layers.10.self_attn.q_proj") == 5
    assert cfg.k_for("model.layers.1.mlp.up_proj") == 3
    assert cfg.k_for("model.layers.1.mlp.down_projection") == 3  # whole components only
    again = KbitConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.module_k == cfg.module_k and again.k_for("x.down_proj") == 5


@pytest.mark.parametrize("module_k,match", [
    ({"down_proj": 6}, r"module_k\['down_proj'\]: must be one of"),
    ({"down_proj": True}, r"module_k\['down_proj'\]"),
    ({"": 4}, "module_k: keys must be non-empty"),
    (["down_proj"], "module_k: must map module names to k"),
])
def test_module_k_bad_values_name_the_field(module_k, match):
    with pytest.raises(ValueError, match=match):
        KbitConfig(k=3, module_k=module_k)


def test_module_k_with_a_custom_codebook_needs_one_k():
    values = [-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="module_k: a custom codebook list holds 8 values for k=3"):
        KbitConfig(k=3, codebook=values, module_k={"down_proj": 5})
    assert KbitConfig(k=3, codebook=values, module_k={"down_proj": 3}).k_for("a.down_proj") == 3
