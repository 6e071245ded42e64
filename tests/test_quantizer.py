"""The Transformers integration end to end on tiny models: on-the-fly quantization, generate, save, reload,
sharding, skip lists, dequantize, device maps and the errors users must see."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import kbit_hf
from kbit_hf import KbitConfig, KbitLinear, KbitMoE
from kbit_hf.backends import reference
from tiny_models import FAMILIES, MOE_FAMILIES, VOCAB, rewritten_copy, tiny_model

FAMILY_LIST = list(FAMILIES)


@pytest.fixture(scope="module")
def fp_folder(tmp_path_factory):
    """family -> folder holding the bf16 tiny model as transformers saves it (per-expert keys for most MoEs)."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            model = tiny_model(family)
            model.save_pretrained(path)
            cache[family] = (str(path), model)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def quantized(fp_folder, tmp_path_factory):
    """family -> (on-the-fly quantized model, its saved folder)."""
    cache = {}

    def get(family):
        if family not in cache:
            path, _ = fp_folder(family)
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4))
            out = tmp_path_factory.mktemp(family + "-kbit")
            model.save_pretrained(out)
            cache[family] = (model, str(out))
        return cache[family]

    return get


def _ids(seed=0, batch=2, length=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _no_quantize(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a pre-quantized load must not quantize")

    monkeypatch.setattr(reference, "quantize", boom)


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_on_the_fly_quantization_replaces_the_right_modules(family, fp_folder, quantized):
    _, fp_model = fp_folder(family)
    model, _ = quantized(family)
    names = {n for n, m in model.named_modules() if isinstance(m, KbitLinear)}
    for name, module in fp_model.named_modules():
        if isinstance(module, nn.Linear):
            leaf = name.rpartition(".")[2]
            if name == "lm_head" or leaf in ("gate", "router", "shared_expert_gate"):
                assert name not in names and type(model.get_submodule(name)) is type(module), name
            else:
                assert name in names, name
    moe = [m for m in model.modules() if isinstance(m, KbitMoE)]
    assert bool(moe) == (family in MOE_FAMILIES)
    for m in moe:
        for p in m.quantized_names:
            assert getattr(m, p).dtype == torch.uint32 and getattr(m, p + "_absmax").dtype == torch.uint8
    assert model.config.quantization_config.k == 4 and model.is_quantized
    ids = _ids()
    ref, got = _logits(fp_model, ids), _logits(model, ids)
    assert ((got - ref).norm() / ref.norm()).item() < 0.35  # k=4 noise on random weights, not garbage


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_kbit_forward_equals_its_dequantized_model(family, quantized, fp_folder):
    """The kbit modules compute exactly what float modules holding the dequantized weights compute (this checks
    the MoE gating, transposed gpt-oss layout, biases and routing weights against transformers' own code)."""
    path, _ = fp_folder(family)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=3), dtype=torch.float32)
    ids = _ids(1)
    q = _logits(model, ids)
    model.dequantize()
    assert not any(isinstance(m, (KbitLinear, KbitMoE)) for m in model.modules())
    assert getattr(model.config, "quantization_config", None) is None
    torch.testing.assert_close(_logits(model, ids), q, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_generate_save_reload_is_bit_identical(family, quantized, monkeypatch):
    model, folder = quantized(family)
    files = os.listdir(folder)
    assert "model.safetensors" in files and "README.md" in files
    assert json.load(open(os.path.join(folder, "config.json")))["quantization_config"]["quant_method"] == "kbit"
    _no_quantize(monkeypatch)
    again = AutoModelForCausalLM.from_pretrained(folder)
    a, b = model.state_dict(), again.state_dict()
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    ids = _ids(2)
    assert torch.equal(_logits(model, ids), _logits(again, ids))
    gen_a = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    gen_b = again.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(gen_a, gen_b) and gen_a.shape[1] == ids.shape[1] + 5


def test_saved_tensors_are_the_packed_format(quantized):
    _, folder = quantized("mixtral")
    sd = load_file(os.path.join(folder, "model.safetensors"))  # Mixtral keeps its on-disk name block_sparse_moe
    packed = sd["model.layers.0.block_sparse_moe.experts.gate_up_proj"]
    absmax = sd["model.layers.0.block_sparse_moe.experts.gate_up_proj_absmax"]
    assert packed.dtype == torch.uint32 and packed.shape == (4, 2 * 72, 2 * 4)  # [E, 2I, nb*k]
    assert absmax.dtype == torch.uint8 and absmax.shape == (4, 144, 2)
    assert sd["model.layers.0.block_sparse_moe.experts.gate_up_proj_scale"].shape == (4,)
    assert sd["model.layers.0.block_sparse_moe.experts.down_proj"].shape == (4, 64, 3 * 4)  # in=72 -> 3 blocks
    assert sd["lm_head.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_sharded_save_reloads_identically(family, quantized, tmp_path, monkeypatch):
    model, _ = quantized(family)
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(tmp_path)
    _no_quantize(monkeypatch)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = _ids(3)
    assert torch.equal(_logits(model, ids), _logits(again, ids))


def test_save_reload_save_is_a_fixed_point(quantized, tmp_path):
    _, folder = quantized("gpt_oss")
    again = AutoModelForCausalLM.from_pretrained(folder)
    again.save_pretrained(tmp_path)
    a = load_file(os.path.join(folder, "model.safetensors"))
    b = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_modules_to_not_convert_with_user_names(fp_folder, tmp_path):
    path, _ = fp_folder("qwen3_moe")
    cfg = KbitConfig(k=2, modules_to_not_convert=["q_proj", "model.layers.1.mlp"])
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.q_proj) is nn.Linear
    assert isinstance(model.model.layers[0].self_attn.k_proj, KbitLinear)
    assert isinstance(model.model.layers[0].mlp.experts, KbitMoE)
    assert not isinstance(model.model.layers[1].mlp.experts, KbitMoE)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(again.model.layers[1].self_attn.q_proj) is nn.Linear
    assert not isinstance(again.model.layers[1].mlp.experts, KbitMoE)
    assert torch.equal(_logits(model, _ids()), _logits(again, _ids()))


def test_tied_embeddings_stay_full_precision(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "fp")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4))
    assert type(q.lm_head) is nn.Linear and q.lm_head.weight is q.model.embed_tokens.weight
    q.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(_logits(q, _ids()), _logits(again, _ids()))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_quantize_lm_head_round_trip(family, fp_folder, tmp_path):
    path, fp_model = fp_folder(family)
    kept = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4))
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4, quantize_lm_head=True))
    assert type(kept.lm_head) is nn.Linear and isinstance(model.lm_head, KbitLinear)
    ids = _ids()
    ref, with_head, without_head = _logits(fp_model, ids), _logits(model, ids), _logits(kept, ids)
    assert not torch.equal(with_head, without_head)
    # a K=4 head costs about as much accuracy as the K=4 body (random weights: relative logit error of a few %)
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(with_head) < 2 * err(without_head) + 0.02, (err(with_head), err(without_head))
    model.save_pretrained(tmp_path)
    saved = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    assert saved["quantize_lm_head"] is True
    assert load_file(os.path.join(tmp_path, "model.safetensors"))["lm_head.weight"].dtype == torch.uint32  # packed
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.lm_head, KbitLinear)
    assert torch.equal(_logits(again, ids), with_head)
    out = again.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (ids.shape[0], ids.shape[1] + 3)


def test_quantize_lm_head_refuses_a_tied_head(tmp_path):
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="ties its output head"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4, quantize_lm_head=True))


@pytest.mark.parametrize("absmax_format", ["fp16", "e4m4"])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_other_k_and_formats_round_trip(k, absmax_format, fp_folder, tmp_path):
    path, _ = fp_folder("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=k, absmax_format=absmax_format))
    want_dtype = torch.uint8 if absmax_format == "e4m4" else torch.float16
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj_absmax.dtype == want_dtype
    # the weights come back within the error a K-bit codebook allows (docs/quality.md has the model-level figures)
    fp = fp_folder("mixtral")[1].model.layers[0]
    q_proj = model.model.layers[0].self_attn.q_proj
    for got, want in ((q_proj.dequantized_weight(torch.float32), fp.self_attn.q_proj.weight),
                      (experts.dequantized_weight("down_proj", torch.float32), fp.mlp.experts.down_proj)):
        rel = ((got - want.float()).norm() / want.float().norm()).item()
        assert rel < {2: 0.6, 3: 0.25, 5: 0.07}[k], (k, absmax_format, rel)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(_logits(model, _ids()), _logits(again, _ids()))


def test_dequantize_on_load(quantized):
    model, folder = quantized("mixtral")
    plain = AutoModelForCausalLM.from_pretrained(folder, quantization_config=KbitConfig(dequantize=True))
    assert not any(isinstance(m, (KbitLinear, KbitMoE)) for m in plain.modules())
    assert getattr(plain.config, "quantization_config", None) is None
    q_proj = model.model.layers[0].self_attn.q_proj
    assert torch.equal(plain.model.layers[0].self_attn.q_proj.weight, q_proj.dequantized_weight(torch.bfloat16))
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(plain.model.layers[1].mlp.experts.down_proj,
                       experts.dequantized_weight("down_proj", torch.bfloat16))
    # logits differ only through the bf16 rounding of the dequantized weights (the kbit ops compute in fp32), which
    # can flip a router's top-k choice in this tiny random MoE: a loose bound (exactness is asserted on weights)
    a, b = _logits(plain, _ids()), _logits(model, _ids())
    assert ((a - b).norm() / b.norm()).item() < 0.1


def test_device_map_cpu_and_auto(quantized, fp_folder):
    path, _ = fp_folder("llama")
    on_cpu = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4), device_map="cpu")
    assert on_cpu.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    _, folder = quantized("llama")
    auto = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    assert torch.equal(_logits(auto, _ids()), _logits(on_cpu, _ids()))


def test_device_map_auto_is_sized_with_packed_bytes(fp_folder, monkeypatch):
    """accelerate sizes the meta model before any weight arrives: it must count k bits per quantized weight."""
    from transformers.integrations.accelerate import compute_module_sizes

    path, fp_model = fp_folder("mixtral")
    seen = {}
    original = kbit_hf.KbitHfQuantizer._process_model_before_weight_loading

    def spy(self, model, **kwargs):
        original(self, model, **kwargs)
        sizes = compute_module_sizes(model, hf_quantizer=self)
        seen["before"] = (sizes[0] if isinstance(sizes, tuple) else sizes)[""]

    monkeypatch.setattr(kbit_hf.KbitHfQuantizer, "_process_model_before_weight_loading", spy)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4))
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = sum(p.numel() * p.element_size() for p in fp_model.parameters())
    # equal up to the zero padding of rows whose length is not a multiple of 32
    assert seen["before"] <= after <= 1.05 * seen["before"] and after < 0.6 * bf16
    sizes = compute_module_sizes(model, hf_quantizer=model.hf_quantizer)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert (sizes[0] if isinstance(sizes, tuple) else sizes)[""] == after + buffers


def test_on_the_fly_into_disk_offload_is_refused(fp_folder, tmp_path):
    path, _ = fp_folder("llama")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.raises(ValueError, match="disk"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(), device_map=device_map,
                                             offload_folder=str(tmp_path))


@pytest.mark.parametrize("field", ["ep_size", "pp_size", "dp_size", "enable_expert_parallel"])
def test_parallelism_other_than_tensor_parallel_is_refused(field):
    import types

    quantizer = kbit_hf.KbitHfQuantizer(KbitConfig(), pre_quantized=False)
    model = tiny_model("llama")
    model.config.distributed_config = types.SimpleNamespace(tp_size=2, **{field: 2})
    with pytest.raises(NotImplementedError, match=field):
        quantizer._process_model_before_weight_loading(model)


def test_nan_weights_fail_loudly(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has 1 NaN"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig())


def test_truncated_or_mismatched_checkpoints_fail_loudly(quantized, tmp_path):
    _, folder = quantized("llama")
    sd = load_file(os.path.join(folder, "model.safetensors"))
    config = json.load(open(os.path.join(folder, "config.json")))

    def write(state, cfg, name):
        d = tmp_path / name
        d.mkdir()
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    missing = {k: v for k, v in sd.items() if k != "model.layers.0.self_attn.q_proj.weight_absmax"}
    with pytest.raises(Exception, match="q_proj.weight_absmax"):
        AutoModelForCausalLM.from_pretrained(write(missing, config, "missing"))
    wrong_k = dict(config, quantization_config=dict(config["quantization_config"], k=3))
    with pytest.raises(Exception, match="mismatch|MISMATCH|size"):
        AutoModelForCausalLM.from_pretrained(write(sd, wrong_k, "wrong_k"))
    fp16_absmax = dict(config, quantization_config=dict(config["quantization_config"], absmax_format="fp16"))
    with pytest.raises(Exception, match="absmax"):
        AutoModelForCausalLM.from_pretrained(write(sd, fp16_absmax, "wrong_format"))
    cut = tmp_path / "cut"
    cut.mkdir()
    raw = open(os.path.join(folder, "model.safetensors"), "rb").read()
    (cut / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    (cut / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_pretrained(cut)


def test_loading_without_import_registration_is_not_silent():
    """The contract is `import kbit_hf`; once imported the method resolves. (Unregistered loads fail in transformers
    itself with a size-mismatch error, verified in docs/usage.md.)"""
    from transformers.quantizers import AutoHfQuantizer

    assert AutoHfQuantizer.supports_quant_method({"quant_method": "kbit", "k": 4})


def test_saved_kbit_model_loads_with_disk_offload(quantized, tmp_path):
    model, folder = quantized("llama")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=str(tmp_path))
    assert torch.equal(_logits(offloaded, _ids()), _logits(model, _ids()))


@pytest.mark.parametrize("how", ("deepcopy", "pickle"))
def test_copies_save_themselves(quantized, tmp_path, how):
    import copy
    import io

    model, _ = quantized("llama")
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert clone.save_pretrained.args[0] is clone and clone.push_to_hub.args[0] is clone
    with torch.no_grad():
        clone.model.layers[0].self_attn.q_proj.weight_scale.mul_(2)
    clone.save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight_scale"],
                       2 * model.model.layers[0].self_attn.q_proj.weight_scale)
    assert "kbit quantization" in open(os.path.join(tmp_path, "README.md")).read()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loaded_experts_are_the_fused_float_experts_quantized(family, fp_folder, quantized):
    """An on-the-fly load merges the per-expert checkpoint tensors (transformers' converters) before kbit quantizes
    them: the packed experts equal the quantization of the float model's fused tensors, bit for bit."""
    _, fp_model = fp_folder(family)
    model, _ = quantized(family)
    for name, m in model.named_modules():
        if isinstance(m, KbitMoE):
            fp = fp_model.get_submodule(name)
            for p in m.quantized_names:
                w = getattr(fp, p).detach()
                packed, absmax, scale = reference.quantize(w.transpose(-1, -2) if m.is_transposed else w,
                                                           getattr(m, p + "_codebook"), 4, m.absmax_format)
                assert torch.equal(getattr(m, p).view(torch.int32), packed.view(torch.int32)), (name, p)
                assert torch.equal(getattr(m, p + "_absmax"), absmax) and torch.equal(getattr(m, p + "_scale"), scale)


def test_kbit_tensors_stored_in_another_dtype_are_refused(quantized, tmp_path):
    # transformers casts each checkpoint tensor to its parameter's dtype: without the header check a float32 'packed'
    # weight or fp16 e4m4 scales would load as silently wrong values
    _, folder = quantized("llama")
    key = "model.layers.0.self_attn.q_proj.weight"
    for suffix, dtype, stored in (("", torch.float32, "F32"), ("_absmax", torch.float16, "F16"),
                                  ("_scale", torch.bfloat16, "BF16"), ("_codebook", torch.float64, "F64")):
        def edit(sd, s=suffix, dt=dtype):
            sd[key + s] = sd[key + s].to(dt)
        d = rewritten_copy(folder, tmp_path, f"dtype{suffix}", edit)
        with pytest.raises(ValueError, match=rf"{key}{suffix} is stored as {stored}"):
            AutoModelForCausalLM.from_pretrained(d)


def test_kbit_values_outside_the_format_are_refused(quantized, tmp_path):
    _, folder = quantized("mixtral")
    key = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "scale_not_pow2": (key + "_scale", lambda t: t * 1.5, "powers of two"),
        "scale_inf": (key + "_scale", lambda t: t * float("inf"), "powers of two"),
        "scale_negative": (key + "_scale", lambda t: -t, "powers of two"),
        "codebook_nan": (key + "_codebook", lambda t: t * float("nan"), "codebook must be finite"),
        "codebook_unsorted": (key + "_codebook", lambda t: t.flip(0), "strictly increasing"),
        "codebook_out_of_range": (key + "_codebook", lambda t: t * 2, r"\[-1, 1\]"),
    }
    for name, (tensor, change, message) in cases.items():
        def edit(sd, k=tensor, f=change):
            sd[k] = f(sd[k])
        with pytest.raises(ValueError, match=message):
            AutoModelForCausalLM.from_pretrained(rewritten_copy(folder, tmp_path, name, edit))
    expert_scale = next(k for k in load_file(os.path.join(folder, "model.safetensors"))
                        if k.endswith("experts.down_proj_scale"))

    def edit(sd):
        sd[expert_scale][1] = 0.3
    with pytest.raises(ValueError, match="down_proj_scale must hold positive finite powers of two"):
        AutoModelForCausalLM.from_pretrained(rewritten_copy(folder, tmp_path, "expert_scale", edit))


def test_fp16_block_scales_must_be_finite(fp_folder, tmp_path):
    path, _ = fp_folder("llama")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4, absmax_format="fp16"))
    model.save_pretrained(tmp_path / "fp16")
    key = "model.layers.0.mlp.down_proj.weight_absmax"

    def edit(sd):
        sd[key][0, 0] = float("inf")
    with pytest.raises(ValueError, match="absmax .fp16 block scales. must be finite"):
        AutoModelForCausalLM.from_pretrained(rewritten_copy(str(tmp_path / "fp16"), tmp_path, "inf", edit))


def test_a_missing_bias_of_a_kbit_layer_is_refused(tmp_path):
    # KbitLinear is marked initialized (its packed tensors must not be 'initialized'), so a missing bias would
    # otherwise keep whatever memory it was allocated in
    model = tiny_model("llama", attention_bias=True)
    model.save_pretrained(tmp_path / "fp")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4))
    assert torch.equal(q.model.layers[0].self_attn.q_proj.bias, model.model.layers[0].self_attn.q_proj.bias)
    q.save_pretrained(tmp_path / "kbit")

    def edit(sd):
        del sd["model.layers.0.self_attn.q_proj.bias"]
    nobias = rewritten_copy(str(tmp_path / "kbit"), tmp_path, "nobias", edit)
    with pytest.raises(ValueError, match="missing model.layers.0.self_attn.q_proj.bias"):
        AutoModelForCausalLM.from_pretrained(nobias)
    # the same with layer 1 offloaded to disk (accelerate then hooks every module, offloaded or not)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "lm_head": "cpu", "model.rotary_emb": "cpu"}
    with pytest.raises(ValueError, match="missing model.layers.0.self_attn.q_proj.bias"):
        AutoModelForCausalLM.from_pretrained(nobias, device_map=device_map, offload_folder=tmp_path / "off")
    sd = load_file(tmp_path / "fp" / "model.safetensors")
    del sd["model.layers.0.self_attn.k_proj.bias"]
    (tmp_path / "fp2").mkdir()
    save_file(sd, tmp_path / "fp2" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "fp2" / "config.json").write_text((tmp_path / "fp" / "config.json").read_text())
    with pytest.raises(ValueError, match="missing model.layers.0.self_attn.k_proj.bias"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "fp2", quantization_config=KbitConfig(k=4))


def test_dequantize_flag_on_a_float_checkpoint_is_refused(fp_folder):
    # it would quantize anyway and save dequantize=True, turning every later load of that folder into a float model
    path, _ = fp_folder("llama")
    with pytest.raises(ValueError, match="dequantize=True .* not kbit-quantized"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4, dequantize=True))


def test_dtype_casts_keep_the_format_dtypes(fp_folder, tmp_path):
    path, _ = fp_folder("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(k=4, absmax_format="fp16"))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    model.to(torch.float16)
    after = model.state_dict()
    kbit = [n for n in before if n.endswith(("_absmax", "_scale", "_codebook")) or n + "_absmax" in before]
    assert any("experts" in n for n in kbit) and any("q_proj" in n for n in kbit)
    for n in kbit:  # the packed tensors and their companions: same dtype, same values
        assert after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]), n
    assert model.model.layers[0].self_attn.q_proj.bias is None  # (llama-style attention: no bias)
    assert model.model.norm.weight.dtype == torch.float16  # the float parameters do follow the cast
    with torch.no_grad():
        out = model(_ids()).logits
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    model.save_pretrained(tmp_path / "after_cast")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "after_cast")
    cb = again.model.layers[0].self_attn.q_proj.weight_codebook
    assert cb.dtype == torch.float32 and torch.equal(cb, before["model.layers.0.self_attn.q_proj.weight_codebook"])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_moe_sentinel_expert_ids_contribute_nothing(family, quantized):
    # ids outside [0, E) (expert-parallel sentinels) add nothing: not their expert's output, not its bias (gpt-oss)
    model, _ = quantized(family)
    moe = next(m for m in model.modules() if isinstance(m, KbitMoE))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, model.config.hidden_size, generator=g).to(model.dtype)
    idx = torch.randint(0, moe.num_experts, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    w_without = w.clone()
    w_without[:, 1] = 0
    with torch.no_grad():
        want = moe(h, idx, w_without)
        for sentinel in (moe.num_experts, -1):
            sent = idx.clone()
            sent[:, 1] = sentinel
            torch.testing.assert_close(moe(h, sent, w), want)


def test_module_k_quantizes_each_module_at_its_k_and_reloads(fp_folder, tmp_path):
    path, _ = fp_folder("qwen3_moe")
    cfg = KbitConfig(k=3, module_k={"self_attn": 5, "mlp.experts": 4, "lm_head": 5})
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    ks = {name: m.k for name, m in model.named_modules() if isinstance(m, (KbitLinear, KbitMoE))}
    assert ks["model.layers.0.self_attn.q_proj"] == 5 and ks["model.layers.0.mlp.experts"] == 4
    head_tied = model.config.tie_word_embeddings
    assert ("lm_head" in ks) == (not head_tied) and ks.get("lm_head", 5) == 5  # a module_k entry quantizes the head
    assert all(k == 3 for name, k in ks.items() if "self_attn" not in name and "experts" not in name
               and name != "lm_head")
    model.save_pretrained(tmp_path)
    saved = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    assert saved["module_k"] == cfg.module_k
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    # a config.json that gives the attention another k than its tensors hold names the module's k
    saved["module_k"] = {"self_attn": 4, "mlp.experts": 4, "lm_head": 5}
    conf = json.load(open(os.path.join(tmp_path, "config.json")))
    conf["quantization_config"] = saved
    json.dump(conf, open(os.path.join(tmp_path, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"config.json says k=4, but model\.layers\.0\.self_attn\.\w+\.weight has"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
