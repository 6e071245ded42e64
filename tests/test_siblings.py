"""Sibling projections (q / k / v, gate / up) held as one fused weight and computed by one call
(kbit_hf/modules.py, KbitSiblings): the same outputs as the layers run one by one, no second copy of the weights,
checkpoints unchanged, and the group split whenever a member's tensors are replaced."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear
from kbit_hf.modules import fuse_siblings, split_siblings
from tiny_models import tiny_model


def _groups(model):
    return list({id(m._siblings): m._siblings for m in model.modules()
                 if isinstance(m, KbitLinear) and m._siblings is not None}.values())


def _folder(tmp_path_factory, family, scale_k=1.0):
    model = tiny_model(family)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(scale_k)  # a per-tensor scale unlike q_proj's
    path = tmp_path_factory.mktemp(f"{family}_{scale_k}")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return _folder(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def scaled_folder(tmp_path_factory):
    return _folder(tmp_path_factory, "llama", scale_k=64.0)


def _load(folder, dtype=torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=KbitConfig(k=4), dtype=dtype,
                                                device_map="cpu").eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_siblings_compute_what_the_layers_compute_alone(tmp_path_factory, family, dtype):
    model = _load(_folder(tmp_path_factory, family), dtype)
    layers = len(model.model.layers)
    expected = layers * (2 if family == "llama" else 1)  # the MoE family's MLPs are experts, not gate / up
    assert len(_groups(model)) == expected
    ids = torch.randint(0, 300, (2, 11))
    state = [dict(vars(g)) for g in _groups(model)]
    fused = _logits(model, ids)
    assert [dict(vars(g)) for g in _groups(model)] == state  # a call changes nothing in a group
    with torch.inference_mode():  # inference tensors keep no version counter
        torch.testing.assert_close(model(ids).logits, fused, rtol=0, atol=0)
    assert split_siblings(model) == expected and not _groups(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss"])  # q / k / v with biases (gpt-oss's MLPs are experts)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_biased_siblings_compute_what_the_layers_compute_alone(tmp_path_factory, family, dtype):
    model = _load(_folder(tmp_path_factory, family, scale_k=64.0), dtype)  # k_proj's scale 64x q_proj's
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._siblings
    assert attn.q_proj.bias is not None and group is not None and group.ratios[1] == 64.0
    assert len(_groups(model)) == len(model.model.layers) * (2 if family == "qwen2" else 1)
    ids = torch.randint(0, 300, (2, 11))
    fused = _logits(model, ids)
    split_siblings(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_deepseek_latent_attention_fuses_its_query_and_compressed_kv_projections(tmp_path, q_lora_rank):
    tiny_model("deepseek_v3", q_lora_rank=q_lora_rank).save_pretrained(tmp_path)
    model = _load(str(tmp_path), torch.float32)
    attn = model.model.layers[1].self_attn
    query = attn.q_proj if q_lora_rank is None else attn.q_a_proj
    assert query._siblings is not None and query._siblings is attn.kv_a_proj_with_mqa._siblings
    assert model.model.layers[1].mlp.shared_experts.gate_proj._siblings is not None
    ids = torch.randint(0, 300, (2, 9))
    fused = _logits(model, ids)
    split_siblings(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


def _alone(layer, x):
    return torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype), layer.bias)


def test_a_trained_bias_gets_its_gradient_through_the_fused_call(tmp_path_factory):
    model = _load(_folder(tmp_path_factory, "qwen2", scale_k=64.0), torch.float32)
    attn = model.model.layers[0].self_attn
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        m.bias.requires_grad_(m is attn.k_proj)
    x = torch.randn(3, attn.q_proj.in_features)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert x._kbit_sibling_parts is None  # one fused call served all three
    g = torch.randn_like(k)
    (k * g).sum().backward()
    torch.testing.assert_close(attn.k_proj.bias.grad, g.sum(0))
    for y, m in zip((q, k, v), (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(y, _alone(m, x), rtol=1e-4, atol=1e-4)


def test_a_bias_changed_in_place_is_the_one_added(tmp_path_factory):
    model = _load(_folder(tmp_path_factory, "qwen2", scale_k=64.0), torch.float32)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():
        attn.k_proj.bias.add_(1.0)
        got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        for y, m in zip(got, (attn.q_proj, attn.k_proj, attn.v_proj)):
            torch.testing.assert_close(y, _alone(m, x), rtol=1e-4, atol=1e-4)


def test_an_input_changed_in_place_or_a_rewritten_weight_drops_the_pending_parts(llama_folder):
    attn = _load(llama_folder, torch.float32).model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():
        attn.q_proj(x)
        x.mul_(2)  # k and v must see the new x
        torch.testing.assert_close(attn.k_proj(x), _alone(attn.k_proj, x), rtol=1e-4, atol=1e-4)
        attn.v_proj.set_weight_(torch.randn(attn.v_proj.out_features, attn.v_proj.in_features))
        torch.testing.assert_close(attn.v_proj(x), _alone(attn.v_proj, x), rtol=1e-4, atol=1e-4)


def test_a_data_parallel_replica_computes_its_own_weights(llama_folder, tmp_path_factory):
    attn = _load(llama_folder, torch.float32).model.layers[0].self_attn
    other = _load(_folder(tmp_path_factory, "llama", scale_k=3.0), torch.float32).model.layers[0].self_attn
    replica = attn.k_proj._replicate_for_data_parallel()  # shares the group through its copied __dict__
    replica._parameters = dict(other.k_proj._parameters)  # as DataParallel fills in each device's copies
    x = torch.randn(3, attn.k_proj.in_features)
    with torch.no_grad():
        torch.testing.assert_close(replica(x), _alone(other.k_proj, x), rtol=1e-4, atol=1e-4)


def test_a_bias_added_or_removed_after_fusing_is_the_one_added(llama_folder):
    attn = _load(llama_folder, torch.float32).model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():
        attn.k_proj.bias = torch.nn.Parameter(torch.randn(attn.k_proj.out_features))
        for m in (attn.q_proj, attn.k_proj, attn.v_proj):
            torch.testing.assert_close(m(x), _alone(m, x), rtol=1e-4, atol=1e-4)
        attn.k_proj.bias = None
        for m in (attn.q_proj, attn.k_proj, attn.v_proj):
            torch.testing.assert_close(m(x), _alone(m, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, cls", [("model.decoder.layers.0.encoder_attn", "BartAttention"),
                                       ("decoder.layers.3.cross_attention", "NllbMoeAttention"),
                                       ("layers.0.x_attn", "KosmosTextAttention"),
                                       ("mask_decoder.cross_attn_token_to_image", "SamAttention"),
                                       ("layers.0.attn", "MllamaTextCrossAttention")])
def test_cross_attention_modules_are_recognised(name, cls):
    from kbit_hf.modules import _is_cross_attention

    assert _is_cross_attention(name, type(cls, (torch.nn.Module,), {})())
    assert not _is_cross_attention("model.layers.0.self_attn", type("LlamaAttention", (torch.nn.Module,), {})())


def test_cross_attention_is_not_fused(tmp_path):
    import transformers

    cfg = transformers.BartConfig(vocab_size=320, d_model=64, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=100,
                                  decoder_ffn_dim=100, max_position_embeddings=64)
    transformers.BartForConditionalGeneration(cfg).save_pretrained(tmp_path)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4),
                                                               device_map="cpu")
    layer = model.model.decoder.layers[0]
    assert layer.self_attn.q_proj._siblings is not None  # q, k and v read one input
    assert layer.encoder_attn.q_proj._siblings is None  # q reads the decoder's states, k and v the encoder's


def test_a_merged_lora_bias_reaches_the_fused_bias(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    model = _load(_folder(tmp_path_factory, "qwen2"), torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj"], lora_bias=True,
                                                  init_lora_weights=False))
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad(), pytest.warns(UserWarning, match="merging LoRA"):
        peft_model.merge_adapter()
    assert model.model.layers[0].self_attn.q_proj._siblings is not None
    fused = _logits(model, ids)
    split_siblings(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_a_cast_of_the_model_reaches_the_fused_bias(tmp_path_factory):
    model = _load(_folder(tmp_path_factory, "qwen2"), torch.float32)
    model.to(torch.bfloat16)
    group = model.model.layers[0].self_attn.q_proj._siblings
    assert group is not None and group._bias().dtype == torch.bfloat16
    ids = torch.randint(0, 300, (2, 7))
    fused = _logits(model, ids)
    split_siblings(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_loading_a_members_bias_splits_the_group(tmp_path_factory):
    model = _load(_folder(tmp_path_factory, "qwen2"), torch.float32)
    attn = model.model.layers[0].self_attn
    new_bias = torch.randn_like(attn.v_proj.bias)
    attn.v_proj.load_state_dict({"bias": new_bias}, strict=False)
    assert attn.q_proj._siblings is None and attn.v_proj._siblings is None
    x = torch.randn(2, attn.v_proj.in_features)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, attn.v_proj.dequantized_weight(), new_bias)
        torch.testing.assert_close(attn.v_proj(x), want, rtol=1e-4, atol=1e-4)


def test_members_are_views_of_one_fused_weight(llama_folder):
    model = _load(llama_folder)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._siblings
    assert group is attn.k_proj._siblings is attn.v_proj._siblings
    base = group.packed.untyped_storage().data_ptr()
    rows = 0
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m.weight.untyped_storage().data_ptr() == base
        assert m.weight.data_ptr() == group.packed[rows].data_ptr()
        rows += m.out_features
    assert rows == group.packed.shape[0]
    assert "fused_with=('q_proj', 'k_proj', 'v_proj')" in repr(attn.k_proj)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    split_siblings(model)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == before  # no second copy while fused


def test_unequal_tensor_scales_are_exact_in_bf16_and_left_unfused_in_fp16(scaled_folder):
    model = _load(scaled_folder)
    group = model.model.layers[0].self_attn.q_proj._siblings
    assert group.ratios[1] != 1.0 and not group.same_scale
    ids = torch.randint(0, 300, (2, 9))
    fused = _logits(model, ids)
    x = torch.randn(3, 64, dtype=torch.float16)
    k_proj = model.model.layers[0].self_attn.k_proj
    assert not group.serves(k_proj, x)  # fp16 would round the k part at the wrong magnitude
    assert group.serves(k_proj, x.bfloat16()) and group.serves(k_proj, x.float())
    split_siblings(model)
    torch.testing.assert_close(fused, _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_a_member_called_on_another_input_runs_alone(llama_folder):
    model = _load(llama_folder, torch.float32)
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(4, 64), torch.randn(4, 64)
    with torch.no_grad():
        q = attn.q_proj(x)  # computes q, k, v of x and keeps k, v
        k_other = attn.k_proj(other)
        k_x, v_x = attn.k_proj(x), attn.v_proj(x)
        q_again = attn.q_proj(x)  # q was handed out already: computed again
        split_siblings(model)
        for got, layer, inp in ((q, attn.q_proj, x), (k_other, attn.k_proj, other), (k_x, attn.k_proj, x),
                                (v_x, attn.v_proj, x), (q_again, attn.q_proj, x)):
            torch.testing.assert_close(got, layer(inp), rtol=1e-6, atol=1e-6)


def test_checkpoints_are_unchanged_and_reload_fused(llama_folder, tmp_path):
    model = _load(llama_folder)
    model.save_pretrained(tmp_path / "fused")
    split_siblings(model)
    model.save_pretrained(tmp_path / "alone")
    a, b = load_file(tmp_path / "fused" / "model.safetensors"), load_file(tmp_path / "alone" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(n.endswith("k_proj.weight") for n in a)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", device_map="cpu").eval()
    assert len(_groups(again)) == 2 * len(again.model.layers)
    ids = torch.randint(0, 300, (1, 7))
    torch.testing.assert_close(_logits(again, ids), _logits(model, ids))


def test_set_weight_rewrites_a_members_rows_and_keeps_the_group(llama_folder):
    model = _load(llama_folder, torch.float32)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._siblings
    w = attn.k_proj.dequantized_weight(torch.float32) * 8  # a new per-tensor scale for k_proj
    q = attn.q_proj.dequantized_weight(torch.float32).flip(0)  # and new rows for the first member
    attn.k_proj.set_weight_(w)
    attn.q_proj.set_weight_(q)
    assert attn.k_proj._siblings is group and group.ratios[1] == 8.0
    assert attn.k_proj.weight.untyped_storage().data_ptr() == group.packed.untyped_storage().data_ptr()
    x = torch.randn(5, 64)
    with torch.no_grad():
        fused = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        split_siblings(model)
        torch.testing.assert_close(attn.k_proj.dequantized_weight(torch.float32), w)
        for got, layer in zip(fused, (attn.q_proj, attn.k_proj, attn.v_proj)):
            torch.testing.assert_close(got, layer(x), rtol=1e-6, atol=1e-6)


def test_load_state_dict_into_a_member_splits_the_group(llama_folder):
    model = _load(llama_folder, torch.float32)
    ids = torch.randint(0, 300, (1, 5))
    reference = _logits(model, ids)
    mlp = model.model.layers[1].mlp
    mlp.up_proj.load_state_dict(mlp.up_proj.state_dict())
    assert mlp.gate_proj._siblings is None and mlp.up_proj._siblings is None
    assert model.model.layers[0].mlp.gate_proj._siblings is not None  # other groups stay
    for m in (mlp.gate_proj, mlp.up_proj):  # each holds its own storage again
        assert m.weight.untyped_storage().nbytes() == m.weight.numel() * m.weight.element_size()
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-5, atol=1e-5)


def test_fused_model_compiles_to_one_call_per_group_without_graph_breaks(llama_folder):
    model = _load(llama_folder, torch.float32)
    ids = torch.randint(0, 300, (1, 6))
    eager = _logits(model, ids)
    calls = []

    def counting(gm, example_inputs):
        calls.append(sum(node.target is torch.ops.kbit.linear for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=counting)(ids).logits
    torch.testing.assert_close(compiled, eager)
    # per layer: q / k / v, o_proj, gate / up, down_proj (7 layers, 4 calls)
    assert calls == [4 * len(model.model.layers)]


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "qwen3_moe"])  # groups with and without biases, experts
def test_compiled_kbit_modules_reach_each_object_by_one_path(tmp_path_factory, family):
    # an object reached by two paths in the compiled forward (a member's group through another member, a bias
    # through the group and its member, the experts' class through every layer) makes TorchDynamo check the two
    # paths' identity in Python (a LAMBDA_GUARD) at every call of the compiled model
    import logging

    model = _load(_folder(tmp_path_factory, family), torch.float32)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.extend(record.getMessage().splitlines())
    logger = logging.getLogger("torch._dynamo.guards.__guards")
    torch._dynamo.reset()
    torch._logging.set_logs(guards=True)
    logger.addHandler(handler)
    try:
        with torch.no_grad():
            torch.compile(model, fullgraph=True, backend="eager")(torch.randint(0, 300, (1, 5)))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    assert any("TENSOR_MATCH" in line for line in lines)  # the guards were captured
    kbit_paths = ("_sibling", "_orig_cls")
    assert not [line for line in lines if "LAMBDA_GUARD" in line and any(p in line for p in kbit_paths)]


def test_a_bias_set_after_compiling_is_the_one_added(llama_folder):
    attn = _load(llama_folder, torch.float32).model.layers[0].self_attn
    members = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(3, attn.q_proj.in_features)
    torch._dynamo.reset()
    qkv = torch.compile(lambda t: [m(t) for m in members], fullgraph=True, backend="eager")
    with torch.no_grad():
        qkv(x)
        attn.k_proj.bias = torch.nn.Parameter(torch.randn(attn.k_proj.out_features))
        for m, y in zip(members, qkv(x)):
            torch.testing.assert_close(y, _alone(m, x), rtol=1e-4, atol=1e-4)


def test_parts_wait_on_their_input_until_every_member_took_its_own(llama_folder):
    attn = _load(llama_folder, torch.float32).model.layers[0].self_attn
    x = torch.randn(3, attn.q_proj.in_features)
    alone = [torch.nn.functional.linear(x, m.dequantized_weight()) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    with torch.no_grad():
        q = attn.q_proj(x)
        assert attn.k_proj(x.clone()).shape == alone[1].shape  # another tensor: k_proj computes anew
        serial, _, parts = x._kbit_sibling_parts
        assert serial == attn.q_proj._siblings.serial and parts[0] is None and parts[1] is not None
        k, v = attn.k_proj(x), attn.v_proj(x)
    assert x._kbit_sibling_parts is None  # every part handed out: x holds no outputs
    for y, ref in zip((q, k, v), alone):
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_lora_adapters_on_fused_members_keep_the_group(llama_folder):
    from peft import LoraConfig, get_peft_model

    model = _load(llama_folder, torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                                  init_lora_weights=False))
    assert len(_groups(model)) == 2 * len(model.model.layers)
    ids = torch.randint(0, 300, (2, 6))
    with torch.no_grad():
        fused = peft_model(ids).logits
        split_siblings(model)
        torch.testing.assert_close(fused, peft_model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_fused_siblings_on_the_gpu_match_the_layers_alone_at_every_kernel(tmp_path):
    """Llama-3-8B's layer widths (q / k / v 4096 + 1024 + 1024 rows, gate / up 2 x 14336): the fused weights take
    the tiled layout on sm_90, and every path (GEMV at 1..64 tokens, GEMM above, dequantize + cuBLAS for prefill)
    gives what the three layers give alone."""
    model = tiny_model("llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cuda",
                                                 dtype=torch.bfloat16).eval()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    members = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    assert attn.q_proj._siblings.packed.shape[0] == 6144 and mlp.gate_proj._siblings.packed.shape[0] == 28672
    fused_layouts = {m._siblings.packed.dtype for m in members}
    for m in (8, 1, 5, 16, 33, 64, 65, 128, 1100):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = [p(x) for p in members]
            split_siblings(model)
            want = [p(x) for p in members]
            fuse_siblings(model)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            assert ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() < 1e-2, m
    if torch.cuda.get_device_capability() == (9, 0):
        assert fused_layouts == {torch.uint8}  # tiled


def test_a_deep_copy_runs_its_layers_alone_and_holds_each_weight_once(llama_folder):
    import copy

    model = _load(llama_folder, torch.float32)
    packed_bytes = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n.endswith("weight")
                                 and not p.is_floating_point())  # noqa: E731
    clone = copy.deepcopy(model)
    assert not _groups(clone) and _groups(model)
    assert packed_bytes(clone) == packed_bytes(model)
    attn = clone.model.layers[0].self_attn
    attn.k_proj.set_weight_(attn.k_proj.dequantized_weight(torch.float32).flip(0))  # reaches the copy's forward
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(attn.k_proj(x), x @ attn.k_proj.dequantized_weight(torch.float32).T,
                                   rtol=1e-4, atol=1e-4)


def test_swapped_parameters_are_the_ones_computed(llama_folder, tmp_path_factory):
    model, other = _load(llama_folder, torch.float32), _load(_folder(tmp_path_factory, "llama", scale_k=3.0),
                                                               torch.float32)
    ids = torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        swapped = torch.func.functional_call(model, dict(other.named_parameters()), (ids,)).logits
        torch.testing.assert_close(swapped, _logits(other, ids), rtol=1e-5, atol=1e-5)
        name = "model.layers.0.self_attn.k_proj.weight_scale"  # only a scale swapped
        scale = dict(model.named_parameters())[name]
        swapped = torch.func.functional_call(model, {name: scale * 2}, (ids,)).logits
        split_siblings(model)
        torch.testing.assert_close(swapped, torch.func.functional_call(model, {name: scale * 2}, (ids,)).logits,
                                   rtol=1e-5, atol=1e-5)


def test_to_empty_splits_the_group(llama_folder):
    model = _load(llama_folder, torch.float32)
    model.to_empty(device="cpu")
    assert not _groups(model)


def test_export_keeps_each_layers_own_parameters(llama_folder):
    model = _load(llama_folder, torch.float32)
    attn = model.model.layers[0].self_attn

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj

        def forward(self, x):
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    program = torch.export.export(Projections(), (torch.randn(2, 64),))
    calls = [n for n in program.graph.nodes if "kbit" in str(n.target)]
    assert len(calls) == 3 and not program.constants


class _RowLayout:
    """A stand-in backend layout for CPU tests: the bit planes viewed as int32 (row order kept, so a member's rows of a
    fused weight are a valid weight of their own); `flip` also reverses the rows (then they are not)."""

    def __init__(self, flip: bool):
        self.flip, self.name = flip, "reversed int32 rows" if flip else "int32 rows"

    def holds(self, packed):
        return packed.dtype == torch.int32

    def wants(self, out_features, in_features, k, absmax_format, device):
        return out_features % 16 == 0

    def from_planes(self, packed, absmax, in_features, k):
        packed = packed.view(torch.int32)  # a copy, as a real layout makes
        return (packed.flip(0), absmax.flip(0)) if self.flip else (packed.clone(), absmax.clone())

    def to_planes(self, packed, absmax, in_features, k):
        if self.flip:
            packed, absmax = packed.flip(0), absmax.flip(0)
        return packed.view(torch.uint32), absmax


@pytest.mark.parametrize("flip", [False, True])
def test_fused_weights_take_their_own_layout_and_unfusable_members_theirs(llama_folder, monkeypatch, flip):
    from kbit_hf import ops

    reference = {n: m._bit_planes() for n, m in _load(llama_folder, torch.float32).named_modules()
                 if isinstance(m, KbitLinear)}
    layout = _RowLayout(flip)
    monkeypatch.setattr(ops, "_LAYOUTS", [layout])
    model = _load(llama_folder, torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    # q / k / v (64 + 32 + 32 rows) fuse where the layout keeps rows; gate / up (2 x 100 rows, not a multiple of 16)
    # fuse in the bit planes either way
    assert (attn.q_proj._siblings is None) == flip and mlp.gate_proj._siblings is not None
    for m in model.modules():
        if isinstance(m, KbitLinear):
            rows = m._siblings.packed.shape[0] if m._siblings is not None else m.out_features
            assert m.layout == (layout.name if rows % 16 == 0 else "bit planes")
            if m._siblings is not None:  # still a view of the fused weight
                assert m.weight.untyped_storage().data_ptr() == m._siblings.packed.untyped_storage().data_ptr()
    for name, m in model.named_modules():  # every layer holds its own weight, whatever the layout (the CPU kernels
        if isinstance(m, KbitLinear):      # read bit planes only, so the stand-in layout is not run)
            assert all(torch.equal(a, b) for a, b in zip(m._bit_planes(), reference[name]))
