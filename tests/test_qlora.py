"""QLoRA on kbit models with PEFT: training leaves the packed weights alone, adapters save and load exactly, and
merge / unmerge re-quantize into the same kbit format (kbit_hf/peft_integration.py, docs/qlora.md)."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

import kbit_hf  # noqa: E402,F401
from kbit_hf import KbitConfig, KbitLinear, ops  # noqa: E402
from kbit_hf import format as fmt  # noqa: E402
from kbit_hf.backends import reference  # noqa: E402
from kbit_hf.peft_integration import KbitLoraLinear  # noqa: E402
from tiny_models import VOCAB, tiny_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def kbit_folder(tmp_path_factory):
    """A saved k=4 kbit tiny Llama (in = 64 and 100: a padded last block)."""
    fp = tmp_path_factory.mktemp("fp")
    tiny_model("llama").save_pretrained(fp)
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4))
    out = tmp_path_factory.mktemp("kbit")
    model.save_pretrained(out)
    return str(out)


def _base(folder):
    # float32 everywhere else, so the references below differ from kbit only by kbit's own rounding
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _ids(seed=0, batch=4, length=24):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _kbit_state(model) -> dict[str, torch.Tensor]:
    return {f"{name.replace('.base_layer', '')}.{p}": t.detach().clone() for name, m in model.named_modules()
            if isinstance(m, KbitLinear) for p, t in m.named_parameters(recurse=False) if p != "bias"}


def _lora_layers(model) -> dict[str, KbitLoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, KbitLoraLinear)}


def _enable_checkpointing(model):
    # activation_checkpointing_enable is the newer name (it deprecates the other); 5.17 has only the older one
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _train(model, ids, steps=10, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


@pytest.fixture(scope="module")
def trained_adapter(kbit_folder, tmp_path_factory):
    """(trained PEFT model, its saved adapter folder, the losses): r=8 LoRA on every linear layer, 10 AdamW steps."""
    model = get_peft_model(_base(kbit_folder), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    losses = _train(model, _ids())
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    return model, str(folder), losses


def test_get_peft_model_wraps_kbit_layers_with_kbit_lora(kbit_folder):
    model = get_peft_model(_base(kbit_folder), LoraConfig(r=4, target_modules=TARGETS))
    layers = _lora_layers(model)
    assert len(layers) == 2 * len(TARGETS)
    assert all(isinstance(m.get_base_layer(), KbitLinear) for m in layers.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_training_lowers_the_loss_and_leaves_packed_weights_alone(kbit_folder):
    base = _base(kbit_folder)
    before = _kbit_state(base)
    _enable_checkpointing(base)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    losses = _train(model, _ids(), steps=8)
    assert losses[-1] < 0.8 * losses[0], losses
    after = _kbit_state(model.get_base_model())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adapter_saves_and_loads_exactly(kbit_folder, trained_adapter):
    model, folder, _ = trained_adapter
    loaded = PeftModel.from_pretrained(_base(kbit_folder), folder)
    assert all(isinstance(m, KbitLoraLinear) for m in _lora_layers(loaded).values())
    saved, again = get_peft_model_state_dict(model), get_peft_model_state_dict(loaded)
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    ids = _ids(1)
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))


def _float_reference(kbit_folder, adapter_folder):
    """The dequantized base with the adapter merged in float (PEFT's own nn.Linear merge): no re-quantization."""
    base = _base(kbit_folder)
    base.dequantize()
    assert not any(isinstance(m, KbitLinear) for m in base.modules())
    return PeftModel.from_pretrained(base, adapter_folder).merge_and_unload()


def _rounding_bound(layer: KbitLinear) -> torch.Tensor:
    """Per element, the largest |dequantized - float| the format's rounding gives for this layer's scales: half the
    widest codebook gap, plus 1/32 for a block scale rounded down (|y| up to 1 + 1/32), times the block's scale."""
    codebook = layer.weight_codebook.float()
    _, absmax = ops.bit_planes(layer.weight, layer.weight_absmax, layer.in_features, layer.k)
    block = fmt.decode_absmax(absmax) * layer.weight_scale
    step = codebook.diff().max() / 2 + 1 / 32
    return (block * step).repeat_interleave(fmt.BLOCK, dim=-1)[:, : layer.in_features] * (1 + 1e-6)


def test_merge_and_unload_requantizes_the_adapted_weight(kbit_folder, trained_adapter):
    _, folder, _ = trained_adapter
    model = PeftModel.from_pretrained(_base(kbit_folder), folder)
    ids = _ids(2)
    unmerged = _logits(model, ids)
    expected = {}  # layer name -> (dequantized base + delta, its quantization)
    for name, layer in _lora_layers(model).items():
        base = layer.get_base_layer()
        target = base.dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
        expected[name.removeprefix("base_model.model.")] = (target, ops.quantize(target, base.weight_codebook, 4,
                                                                                  "e4m4"))
    base_logits = _logits(_base(kbit_folder), ids)
    reference_model = _float_reference(kbit_folder, folder)
    reference = _logits(reference_model, ids)
    assert torch.allclose(unmerged, reference, atol=1e-4, rtol=0)  # unmerged = dequantized base + delta, in float

    with pytest.warns(UserWarning, match="quantizes the merged weight again"):
        merged = model.merge_and_unload()
    layers = {n: m for n, m in merged.named_modules() if isinstance(m, KbitLinear)}
    assert set(layers) == set(expected)
    assert not any(isinstance(m, KbitLoraLinear) for m in merged.modules())
    for name, layer in layers.items():
        target, (packed, absmax, scale) = expected[name]
        assert torch.equal(layer.weight, packed) and torch.equal(layer.weight_absmax, absmax)
        assert torch.equal(layer.weight_scale, scale)  # bit-identical to quantizing the float reference weight
        error = (layer.dequantized_weight(torch.float32) - target).abs()
        assert (error <= _rounding_bound(layer)).all(), name
    # The merged model is the float reference quantized once more, so its logits are off the reference's by what
    # k=4 rounding does to a model: measured here on the float model the kbit base came from (rel. 0.18 on this
    # random tiny model, against 1.25 for the base without the adapter)
    float_logits = _logits(tiny_model("llama").float(), ids)
    quantization_error = _rel(base_logits, float_logits)
    merge_error = _rel(_logits(merged, ids), reference)
    assert merge_error < 1.5 * quantization_error, (merge_error, quantization_error)
    assert merge_error < 0.5 * _rel(base_logits, reference)


def test_merging_an_untrained_adapter_changes_no_byte(kbit_folder):
    base = _base(kbit_folder)
    before = _kbit_state(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=TARGETS))  # lora_B = 0: a zero delta
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        merged = model.merge_and_unload()
    after = _kbit_state(merged)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_unmerge_after_merge_is_within_two_roundings(kbit_folder, trained_adapter):
    _, folder, _ = trained_adapter
    model = PeftModel.from_pretrained(_base(kbit_folder), folder)
    layers = _lora_layers(model)
    original = {n: m.get_base_layer().dequantized_weight(torch.float32) for n, m in layers.items()}
    ids = _ids(3)
    adapted = _logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.merge_adapter()
        merged_bound = {n: _rounding_bound(m.get_base_layer()) for n, m in layers.items()}
        model.unmerge_adapter()
    changed = total = 0
    for name, layer in layers.items():
        base = layer.get_base_layer()
        assert not layer.merged
        error = (base.dequantized_weight(torch.float32) - original[name]).abs()
        # merge rounds dequant(W) + delta, unmerge rounds dequant(merged) - delta: each within its layer's bound
        assert (error <= merged_bound[name] + _rounding_bound(base)).all(), name
        changed += int((error > 0).sum())
        total += error.numel()
    assert changed > 0  # not exact: some weights come back on a neighbouring code
    # the adapter applies on top of the unmerged base again, off by the rounding left in the base
    assert _rel(_logits(model, ids), adapted) < 1.5 * _rel(_logits(_base(kbit_folder), ids),
                                                          _logits(tiny_model("llama").float(), ids))


def test_merged_model_saves_and_reloads_as_a_kbit_checkpoint(kbit_folder, trained_adapter, tmp_path, monkeypatch):
    _, folder, _ = trained_adapter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        merged = PeftModel.from_pretrained(_base(kbit_folder), folder).merge_and_unload()
    merged.save_pretrained(tmp_path)
    assert "kbit quantization" in (tmp_path / "README.md").read_text()

    def boom(*args, **kwargs):
        raise AssertionError("a saved kbit model must load without quantizing")

    monkeypatch.setattr(reference, "quantize", boom)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert reloaded.config.quantization_config.k == 4
    sd_a, sd_b = merged.state_dict(), reloaded.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    ids = _ids(4)
    assert torch.equal(_logits(merged, ids), _logits(reloaded, ids))


def test_merge_into_a_dequantized_model_is_exact(kbit_folder, trained_adapter):
    """The way to keep float layers: dequantize the base first; PEFT's own merge then adds the delta in float."""
    model, folder, _ = trained_adapter
    merged = _float_reference(kbit_folder, folder)
    for name, layer in _lora_layers(model).items():
        float_layer = merged.get_submodule(name.removeprefix("base_model.model."))
        assert type(float_layer) is nn.Linear
        target = layer.get_base_layer().dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
        assert torch.equal(float_layer.weight, target)


def test_two_adapters_merge_in_one_requantization(kbit_folder):
    model = get_peft_model(_base(kbit_folder), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.get_base_layer()
    target = (base.dequantized_weight(torch.float32) + layer.get_delta_weight("default").float()
              + layer.get_delta_weight("second").float())
    packed, absmax, scale = ops.quantize(target, base.weight_codebook, 4, "e4m4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        merged = model.merge_and_unload(adapter_names=["default", "second"])
    merged_layer = merged.model.layers[0].self_attn.q_proj
    assert type(merged_layer) is KbitLinear
    assert torch.equal(merged_layer.weight, packed) and torch.equal(merged_layer.weight_absmax, absmax)
    assert torch.equal(merged_layer.weight_scale, scale)


def test_lora_bias_merges_into_the_float_bias(tmp_path):
    tiny_model("llama", attention_bias=True).save_pretrained(tmp_path)
    kbit = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), dtype=torch.float32)
    model = get_peft_model(kbit, LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False))
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    expected = layer.get_base_layer().bias + layer.lora_B["default"].bias * layer.scaling["default"]
    expected = expected.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        merged = model.merge_and_unload()
    assert torch.equal(merged.model.layers[1].self_attn.q_proj.bias, expected)


def test_a_lora_bias_without_a_base_bias_refuses_the_merge_before_anything_changes(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)  # no attention biases
    kbit = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), dtype=torch.float32)
    model = get_peft_model(kbit, LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False))
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    before = layer.get_base_layer().weight.clone()
    with pytest.raises(RuntimeError, match="no bias to merge it into"):
        layer.merge()
    assert torch.equal(layer.get_base_layer().weight, before) and not layer.merged


@pytest.mark.parametrize("config, match", [
    (dict(use_dora=True), "DoRA"),
    (dict(init_lora_weights="pissa"), "pissa"),
    (dict(init_lora_weights="olora"), "olora"),
])
def test_lora_variants_that_need_the_dense_weight_are_refused(kbit_folder, config, match):
    with pytest.raises(ValueError, match=match):
        get_peft_model(_base(kbit_folder), LoraConfig(r=4, target_modules=["q_proj"], **config))


def test_lora_on_packed_parameters_is_refused(tmp_path):
    tiny_model("mixtral").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4))
    with pytest.raises(ValueError, match="gate_up_proj.*packed kbit indices"):
        get_peft_model(model, LoraConfig(r=4, target_modules=[], target_parameters=["experts.gate_up_proj"]))


@pytest.mark.parametrize("order", ["kbit_hf first", "peft first"])
def test_the_peft_hook_is_installed_in_either_import_order(order):
    imports = ["import kbit_hf", "import peft"] if order == "kbit_hf first" else ["import peft", "import kbit_hf"]
    code = "\n".join([
        "import sys",
        imports[0],
        # kbit_hf alone must not import peft (it is optional and slow to import)
        "assert 'peft' not in sys.modules" if order == "kbit_hf first" else "",
        # transformers asks find_spec whether peft is installed: that must neither import it nor spend the hook
        "import importlib.util; assert importlib.util.find_spec('peft') is not None and 'peft' not in sys.modules"
        if order == "kbit_hf first" else "",
        imports[1],
        "from peft.tuners.lora.model import LoraModel",
        "assert getattr(LoraModel._create_new_module, '_kbit_original', None) is not None",
        "print('ok')",
    ])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(kbit_hf.__file__))] + sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
