"""End to end on a GPU (skipped without one): on-the-fly quantization on the device gives the same bytes as on
the CPU, generation runs, and the saved folder reloads onto the GPU identically."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear, KbitMoE
from tiny_models import VOCAB, rewritten_copy, tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family,head", [("llama", False), ("llama", True), ("mixtral", False), ("gpt_oss", False)])
def test_quantize_on_gpu_matches_cpu_and_reloads(family, head, tmp_path):
    tiny_model(family).save_pretrained(tmp_path / "fp")
    cfg = KbitConfig(k=4, quantize_lm_head=head)
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg, device_map="cpu")
    gpu = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg, device_map="cuda")
    assert isinstance(gpu.lm_head, KbitLinear) == head
    a, b = cpu.state_dict(), gpu.state_dict()
    kbit_keys = [k for k, m in gpu.named_modules() if isinstance(m, (KbitLinear, KbitMoE))]
    assert kbit_keys
    for key in a:
        assert b[key].device.type == "cuda"
        assert torch.equal(a[key], b[key].cpu()), key  # quantization is device independent, bit for bit
    ids = torch.randint(0, VOCAB, (1, 12), device="cuda")
    with torch.no_grad():
        lg = gpu(ids).logits.float()
        lc = cpu(ids.cpu()).logits.float()
    torch.testing.assert_close(lg.cpu(), lc, rtol=0.05, atol=0.05)  # bf16 activations on both, different kernels
    out = gpu.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 20)
    gpu.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cuda")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, gpu(ids).logits)
    assert torch.equal(again.generate(ids, max_new_tokens=8, do_sample=False), out)


def test_default_device_map_puts_the_model_on_the_gpu(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=3))
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "cuda"


def test_moe_load_peak_is_about_one_layer_of_float_experts(tmp_path):
    """On-the-fly load of an MoE checkpoint stored per expert: besides the final model, the GPU holds about one
    layer's float experts at a time (it held two while the NaN/Inf check used torch.isfinite's temporaries)."""
    from kbit_hf.modules import is_fused_experts

    model = tiny_model("mixtral", hidden_size=512, intermediate_size=1536, num_local_experts=8, num_hidden_layers=3)
    experts = next(m for m in model.modules() if is_fused_experts(m))
    layer_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    model.save_pretrained(tmp_path)
    del model, experts
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cuda")
    torch.cuda.synchronize()
    final = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    print(f"one layer of bf16 experts {layer_bytes / 2**20:.1f} MiB; final {final / 2**20:.1f} MiB; "
          f"peak {peak / 2**20:.1f} MiB; peak - final = {(peak - final) / layer_bytes:.2f} layers")
    assert any(isinstance(m, KbitMoE) for m in q.modules())
    assert peak - final <= 1.25 * layer_bytes


def _greedy(model, ids, n, **kw):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()  # [B, n], [B, n, V]


@pytest.mark.parametrize("family,batch", [("llama", 2), ("qwen3_moe", 4), ("qwen3_moe", 520)])
def test_static_cache_generate_compiles_into_cuda_graphs_and_matches_eager(family, batch, tmp_path):
    """`cache_implementation="static"` auto-compiles the decode step (fullgraph: a graph break would raise) and
    replays it as CUDA graphs; tokens and logits match eager decoding.

    qwen3_moe at batch 520 routes 1040 rows per layer: the path for many rows per expert, captured as well."""
    from transformers import CompileConfig
    from torch._dynamo.utils import counters

    tiny_model(family).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cuda")
    assert model.hf_quantizer.is_compileable
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, 9), device="cuda")
    n = 12
    with torch.no_grad():
        tok_e, lg_e = _greedy(model, ids, n)
        torch._dynamo.reset()
        counters.clear()
        cc = CompileConfig(fullgraph=True)
        _greedy(model, ids, n, cache_implementation="static", compile_config=cc)  # compile + record
        tok_c, lg_c = _greedy(model, ids, n, cache_implementation="static", compile_config=cc)  # replay
    assert counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # Compare step by step up to each sequence's first differing token; a difference is allowed only where eager's
    # top two logits were within tolerance (a near tie that rounding can flip). The compiled router rounds
    # differently from eager, so with hundreds of sequences a router near-tie can also send one token to another
    # expert: there up to 2% of the sequences may differ.
    tol = 0.05 * lg_e.abs().amax().item()
    bad = []
    for b in range(batch):
        diff = (tok_e[b] != tok_c[b]).nonzero()
        stop = int(diff[0]) if len(diff) else n
        close = torch.allclose(lg_c[b, :stop], lg_e[b, :stop], rtol=0.05, atol=tol)
        if close and stop < n:
            top2 = lg_e[b, stop].topk(2).values
            close = (top2[0] - lg_e[b, stop, tok_c[b, stop]]).item() <= tol
        if not close:
            bad.append(b)
    assert len(bad) <= 0.02 * batch, f"sequences differing beyond tolerance: {bad[:20]}"
    # a sequence that took the other side of a near tie goes on differently to its end, so count sequences, not tokens
    same = (tok_e == tok_c).all(dim=1).float().mean().item()
    assert same > 0.8, f"only {same:.1%} of the sequences decoded identically"


def test_loads_onto_the_gpu_check_the_kbit_values(tmp_path):
    """The loader's value and dtype checks run on the tensors where they land: here on the GPU."""
    tiny_model("mixtral").save_pretrained(tmp_path / "fp")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4, absmax_format="fp16"),
                                             device_map="cuda")
    q.save_pretrained(tmp_path / "q")
    key = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "scale": (lambda sd: sd[key + "_scale"].mul_(1.5), "powers of two"),
        "expert_scale": (lambda sd: next(t for n, t in sd.items() if n.endswith("down_proj_scale")).__setitem__(1, 0.3),
                         "down_proj_scale must hold positive"),
        "codebook": (lambda sd: sd.__setitem__(key + "_codebook", sd[key + "_codebook"].flip(0)), "strictly increasing"),
        "absmax_inf": (lambda sd: sd[key + "_absmax"].__setitem__((0, 0), float("inf")), "must be finite"),
        "absmax_dtype": (lambda sd: sd.__setitem__(key + "_absmax", sd[key + "_absmax"].bfloat16()), "stored as BF16"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            AutoModelForCausalLM.from_pretrained(rewritten_copy(tmp_path / "q", tmp_path, name, edit),
                                                 device_map="cuda")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cuda")  # the untouched folder loads
    ids = torch.randint(0, VOCAB, (1, 6), device="cuda")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, q(ids).logits)


def test_dtype_cast_on_the_gpu_keeps_the_format_dtypes(tmp_path):
    tiny_model("mixtral").save_pretrained(tmp_path / "fp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4,
                                                 absmax_format="fp16"), device_map="cuda")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    kbit = [n for n in before if n.endswith(("_absmax", "_scale", "_codebook")) or n + "_absmax" in before]
    ids = torch.randint(0, VOCAB, (2, 7), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
    model.to(torch.float16)
    after = model.state_dict()
    for n in kbit:
        assert after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]), n
    with torch.no_grad():
        got = model(ids).logits
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)  # bf16 -> fp16 activations, same weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expert_linear_input_gradient_on_the_gpu(dtype):
    from kbit_hf import format as fmt
    from kbit_hf import ops
    from kbit_hf.backends import reference

    E, out, inp = 5, 40, 300
    g = torch.Generator().manual_seed(1)
    cb = fmt.nf_codebook(4)
    p, a, s = (t.cuda() for t in reference.quantize(torch.randn(E, out, inp, generator=g), cb, 4, "e4m4"))
    cb = cb.cuda()
    ids = torch.tensor([4, 0, 5, 2, -1, 1, 0, 4, 3], device="cuda")  # 5 (== E) and -1: sentinels
    x = torch.randn(len(ids), inp, generator=g).to(dtype).cuda().requires_grad_(True)
    gy = torch.randn(len(ids), out, generator=g).to(dtype).cuda()
    (ops.expert_linear(x, ids, p, a, s, cb, 4, inp) * gy).sum().backward()
    wd = reference.dequantize(p, a, s, cb, 4, inp, torch.float32).double()
    want = torch.stack([gy[r].double() @ wd[e] if 0 <= e < E else torch.zeros(inp, dtype=torch.float64, device="cuda")
                        for r, e in enumerate(ids.tolist())])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.grad.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_moe_model_backward_on_the_gpu_matches_its_dequantized_model(tmp_path):
    tiny_model("mixtral", dtype=torch.float32).save_pretrained(tmp_path / "fp")
    grads = []
    for dequantize in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4),
                                                     device_map="cuda")
        if dequantize:
            model.dequantize()
        emb = model.get_input_embeddings().weight
        emb.requires_grad_(True)
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
        model(ids, labels=ids).loss.backward()
        grads.append(emb.grad)
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-6)


def _split_over_two_gpus(model) -> dict:
    """A device_map putting the first half of the decoder layers (and the embeddings) on GPU 0, the rest on GPU 1."""
    n = model.config.num_hidden_layers
    dmap = {}
    for name, _ in model.model.named_children():
        if name == "layers":
            dmap.update({f"model.layers.{i}": 0 if i < n // 2 else 1 for i in range(n)})
        else:
            dmap[f"model.{name}"] = 1 if name == "norm" else 0
    dmap["lm_head"] = 1
    return dmap


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("family,wide", [("llama", False), ("llama", True), ("qwen3_moe", False)])
def test_device_map_over_two_gpus_matches_one_gpu(family, wide, tmp_path):
    """Decoder layers split over two GPUs by device_map, quantized on the fly and loaded pre-quantized: the same
    logits and greedy tokens as the model on one GPU, and the kbit tensors of each layer on its own GPU. wide:
    4096-wide layers, held in the tiled layout (TMA descriptors and kernels per device)."""
    over = dict(hidden_size=4096, intermediate_size=4096, num_attention_heads=32, num_key_value_heads=8) if wide else {}
    tiny_model(family, num_hidden_layers=4, **over).save_pretrained(tmp_path / "fp")
    cfg = KbitConfig(k=4)
    one = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg, device_map="cuda:0")
    one.save_pretrained(tmp_path / "q")
    dmap = _split_over_two_gpus(one)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref = one(ids.to("cuda:0")).logits.float().cpu()
        ref_tokens = one.generate(ids.to("cuda:0"), max_new_tokens=6, do_sample=False).cpu()
    for source, kw in ((tmp_path / "fp", dict(quantization_config=cfg)), (tmp_path / "q", {})):
        two = AutoModelForCausalLM.from_pretrained(source, device_map=dmap, **kw)
        kbit = [m for m in two.modules() if isinstance(m, (KbitLinear, KbitMoE))]
        assert {p.device.index for m in kbit for p in m.parameters()} == {0, 1}
        for name, m in two.named_modules():
            if isinstance(m, (KbitLinear, KbitMoE)) and name.startswith("model.layers."):
                want = dmap[".".join(name.split(".")[:3])]
                assert {p.device.index for p in m.parameters()} == {want}, name
        if wide:
            assert any(m.layout != "bit planes" for m in kbit if isinstance(m, KbitLinear)), "no tiled layer on 2 GPUs"
        with torch.no_grad():
            logits = two(ids.to("cuda:0")).logits.float().cpu()
            tokens = two.generate(ids.to("cuda:0"), max_new_tokens=6, do_sample=False).cpu()
        torch.testing.assert_close(logits, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
        assert torch.equal(tokens, ref_tokens), source
        del two
