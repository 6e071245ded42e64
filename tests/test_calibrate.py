"""Calibrated quantization (kbit_hf.calibrate) on tiny models and random matrices, CPU only: the result is an ordinary
kbit checkpoint, error feedback beats round-to-nearest on correlated inputs, bad calibration data fails clearly, runs
are deterministic, every MoE family runs."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear, KbitMoE, calibrate
from kbit_hf import format as fmt
from kbit_hf.backends import reference
from tiny_models import MOE_FAMILIES, VOCAB, byte_tokenizer as _byte_tokenizer, tiny_model

N_TOKENS, SEQ_LEN = 512, 64



def _ids(n=4096, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, seed=1):
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits.float()


def _quantize(model, k=4, **kwargs):
    kwargs = {"n_tokens": N_TOKENS, "seq_len": SEQ_LEN, "progress": False, **kwargs}
    return calibrate.quantize(model, KbitConfig(k=k), calibration=kwargs.pop("calibration", _ids()),
                                      **kwargs)


def _correlated(n_in=100, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g) * 0.3 + torch.eye(n_in)
    x = torch.randn(tokens, n_in, generator=g) @ mix
    x[:, 5] = 0  # an input that never fires
    return x


# ---- one matrix ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
def test_identity_hessian_is_round_to_nearest(k, absmax_format):
    w = torch.randn(24, 100)  # 100 inputs: a padded last block
    w[3, :32] = 0  # an all-zero block
    cb = fmt.nf0_codebook(k)
    enc = calibrate.gptq_rows(w, torch.eye(100), cb, absmax_format, order="natural", scales="rtn")
    packed, absmax, scale = reference.quantize(w, cb, k, absmax_format)
    assert torch.equal(calibrate.pack_rows(enc, k, cb), packed)
    assert torch.equal(enc.codes, absmax)
    assert torch.equal(enc.row_scale, scale.expand(24))


@pytest.mark.parametrize("order,scales", [(o, s) for o in calibrate.ORDERS for s in calibrate.SCALES
                                          if not (o == "act" and s.startswith("dynamic"))])
def test_chosen_values_are_what_the_format_decodes(order, scales):
    x = _correlated()
    w = torch.randn(40, 100)
    cb = fmt.nf0_codebook(3)
    enc = calibrate.gptq_rows(w, x.T @ x / x.shape[0], cb, "e4m4", segments=[16, 24], order=order, scales=scales)
    packed = calibrate.pack_rows(enc, 3, cb)
    for rows, scale in ((slice(0, 16), enc.row_scale[0]), (slice(16, 40), enc.row_scale[16])):
        decoded = reference.dequantize(packed[rows], enc.codes[rows], scale, cb, 3, 100)
        assert torch.equal(decoded, enc.values[rows])
    # each stacked matrix keeps the per-tensor scale of its own original weights
    assert torch.equal(enc.row_scale[0], reference.quantize(w[:16], cb, 3, "e4m4")[2])
    assert torch.equal(enc.row_scale[16], reference.quantize(w[16:], cb, 3, "e4m4")[2])


@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
def test_error_feedback_lowers_the_layer_output_error(k):
    x = _correlated()
    w = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    cb = fmt.nf0_codebook(k)
    rtn = reference.dequantize(*reference.quantize(w, cb, k, "e4m4"), cb, k, 100)

    def out_err(q):
        return float((x @ (w - q).T).square().sum())

    h = x.T @ x / x.shape[0]
    plain = calibrate.gptq_rows(w, h, cb, "e4m4", order="natural", scales="rtn")  # scales fixed as RTN's
    best = calibrate.gptq_rows(w, h, cb, "e4m4")  # the defaults
    assert out_err(plain.values) < 0.8 * out_err(rtn)
    assert out_err(best.values) < out_err(plain.values)
    assert calibrate.relative_error(w, best.values, h) == pytest.approx(
        out_err(best.values) / float((x @ w.T).square().sum()), rel=1e-3)


def test_act_order_needs_fixed_scales():
    with pytest.raises(ValueError, match="fixed"):
        calibrate.gptq_rows(torch.randn(4, 64), torch.eye(64), fmt.nf0_codebook(4), "e4m4", order="act",
                            scales="dynamic")


# ---- whole models ----------------------------------------------------------------------------------------------

def test_checkpoint_loads_and_matches_the_returned_model(tmp_path):
    model = _quantize(tiny_model("llama"), out=tmp_path / "q")
    assert all(isinstance(m, KbitLinear) for n, m in model.named_modules() if n.endswith("_proj"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert torch.equal(_logits(loaded), _logits(model))
    # the same tensors, dtypes and shapes as a round-to-nearest checkpoint
    rtn_dir = tmp_path / "rtn"
    fp_dir = tmp_path / "fp"
    tiny_model("llama").save_pretrained(fp_dir)
    AutoModelForCausalLM.from_pretrained(fp_dir, quantization_config=KbitConfig(k=4)).save_pretrained(rtn_dir)
    ours, rtn = load_file(tmp_path / "q" / "model.safetensors"), load_file(rtn_dir / "model.safetensors")
    assert sorted(ours) == sorted(rtn)
    assert all(ours[key].dtype == rtn[key].dtype and ours[key].shape == rtn[key].shape for key in ours)
    assert not all(torch.equal(ours[key], rtn[key]) for key in ours)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == KbitConfig(k=4).to_dict()
    assert config["kbit_calibration"]["n_tokens"] == N_TOKENS
    card = (tmp_path / "q" / "README.md").read_text()
    assert "## kbit quantization" in card and "## kbit calibration" in card
    # saving again replaces the calibration section instead of adding a second one
    calibrate.save(model, tmp_path / "q")
    assert (tmp_path / "q" / "README.md").read_text().count("## kbit calibration") == 1


def test_calibration_from_a_folder_with_text(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "fp")
    _byte_tokenizer().save_pretrained(tmp_path / "fp")
    text = "The quick brown fox jumps over the lazy dog. " * 40
    model = calibrate.quantize(str(tmp_path / "fp"), KbitConfig(k=3), calibration=[text, text],
                                       n_tokens=N_TOKENS, seq_len=SEQ_LEN, out=tmp_path / "q", progress=False)
    assert "2 text(s)" in model.kbit_calibration["calibration"]
    assert os.path.exists(tmp_path / "q" / "tokenizer.json")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("calibration,kwargs,match", [
    ("", {}, "empty"),
    ([], {}, "empty"),
    (torch.zeros(0, dtype=torch.long), {}, "empty"),
    (torch.randn(600), {}, "integer tensor"),
    (_ids(300), {}, "too short"),
    (_ids(), {"n_tokens": 32}, "less than one window"),
    (_ids(), {"seq_len": 0}, "positive integer"),
    ("some text", {}, "tokenizer"),
    (3.5, {}, "text, a list of texts or token ids"),
])
def test_bad_calibration_data_is_a_clear_error(calibration, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _quantize(tiny_model("llama"), calibration=calibration, **kwargs)


def test_already_quantized_model_is_refused():
    model = _quantize(tiny_model("llama"))
    with pytest.raises(ValueError, match="already quantized"):
        _quantize(model)


def test_deterministic_given_the_seed():
    a = _quantize(tiny_model("llama"), seed=3).state_dict()
    b = _quantize(tiny_model("llama"), seed=3).state_dict()
    c = _quantize(tiny_model("llama"), seed=4).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert not all(torch.equal(a[key], c[key]) for key in a)
    ids = _ids()
    assert torch.equal(calibrate.calibration_windows(ids, 512, 64, 3), calibrate.calibration_windows(ids, 512, 64, 3))
    assert not torch.equal(calibrate.calibration_windows(ids, 512, 64, 3),
                           calibrate.calibration_windows(ids, 512, 64, 4))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_calibrates_and_reloads(family, tmp_path):
    fp_dir = tmp_path / "fp"
    tiny_model(family).save_pretrained(fp_dir)  # per-expert keys on disk for most families: the loader fuses them
    model = calibrate.quantize(str(fp_dir), KbitConfig(k=4), calibration=_ids(), n_tokens=N_TOKENS,
                                       seq_len=SEQ_LEN, out=tmp_path / "q", progress=False)
    assert any(isinstance(m, KbitMoE) for m in model.modules())
    info = model.kbit_calibration
    assert info["experts"] > 0 and info["experts_round_to_nearest"] == 0 and not info["modules_round_to_nearest"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert torch.equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_sequential_groups(family, tmp_path):
    model = _quantize(tiny_model(family), sequential=True, out=tmp_path)
    assert model.kbit_calibration["sequential"] is True
    groups = [g["modules"] for g in model.kbit_calibration["groups"] if g["modules"][0].startswith("model.layers.1.")]
    names = [[m.rpartition(".")[2] for m in g] for g in groups]
    assert names[:2] == [["q_proj", "k_proj", "v_proj"], ["o_proj"]]  # grouped by shared input, in call order
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path)), _logits(model))


def test_experts_with_too_few_tokens_keep_round_to_nearest():
    fp = tiny_model("mixtral")
    experts = {n: {p: getattr(m, p).detach().clone() for p in ("gate_up_proj", "down_proj")}
               for n, m in fp.named_modules() if n.endswith("experts")}
    model = _quantize(fp, min_expert_tokens=10**9)
    assert model.kbit_calibration["experts_round_to_nearest"] == model.kbit_calibration["experts"] == 16
    cb = KbitConfig(k=4).codebook_tensor()
    for name, params in experts.items():
        moe = model.get_submodule(name)
        for pname, w in params.items():
            packed, absmax, scale = reference.quantize(w, cb, 4, "e4m4")
            assert torch.equal(getattr(moe, pname), packed) and torch.equal(getattr(moe, pname + "_absmax"), absmax)
            assert torch.equal(getattr(moe, pname + "_scale"), scale)


def test_cli(tmp_path, capsys):
    from kbit_hf import calibrate_cli

    tiny_model("llama").save_pretrained(tmp_path / "fp")
    _byte_tokenizer().save_pretrained(tmp_path / "fp")
    text = tmp_path / "calib.txt"
    text.write_text("Calibration text for a tiny model. " * 60)
    calibrate_cli.main(["--model", str(tmp_path / "fp"), "--k", "3", "--calibration", str(text), "--out",
                        str(tmp_path / "q"), "--n-tokens", "512", "--seq-len", "64", "--quiet"])
    assert "saved" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert loaded.config.quantization_config.k == 3
    assert "calib.txt" in loaded.config.kbit_calibration["calibration"]
