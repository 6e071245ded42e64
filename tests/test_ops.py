"""The op interface: reference semantics, autograd w.r.t. the input, sentinels, and torch.compile tracing."""

import pytest
import torch
import torch.nn.functional as F

import kbit_hf  # noqa: F401  (registers torch.ops.kbit.*)
from kbit_hf import format as fmt
from kbit_hf import ops
from kbit_hf.backends import reference


def _packed(shape, k=4):
    w = torch.randn(shape)
    return w, ops.quantize(w, fmt.nf_codebook(k), k, "e4m4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_dequantized_matmul(dtype):
    w, (p, a, s) = _packed((40, 70))
    cb = fmt.nf_codebook(4)
    x = torch.randn(3, 5, 70).to(dtype)
    bias = torch.randn(40).to(dtype)
    y = ops.linear(x, p, a, s, cb, 4, 70, bias)
    want = (F.linear(x.float(), ops.dequantize(p, a, s, cb, 4, 70, torch.float32)) + bias.float()).to(dtype)
    assert y.dtype == dtype and y.shape == (3, 5, 40)
    torch.testing.assert_close(y, want)


def test_linear_gradient_wrt_input():
    w, (p, a, s) = _packed((24, 50))
    cb = fmt.nf_codebook(4)
    x = torch.randn(4, 50, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
    y = ops.linear(x, p, a, s, cb, 4, 50, bias)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    wd = ops.dequantize(p, a, s, cb, 4, 50, torch.float64)
    torch.testing.assert_close(x.grad, g @ wd)
    torch.testing.assert_close(bias.grad, g.sum(0))


def test_a_trained_bias_gets_its_gradient_when_the_input_needs_none():
    """The eager path (no autograd) runs only when neither x nor the bias asks for a gradient."""
    _, (p, a, s) = _packed((24, 64))
    cb = fmt.nf_codebook(4)
    x = torch.randn(3, 64)
    bias = torch.randn(24, requires_grad=True)
    y = ops.linear_forward(x, p, a, s, cb, 4, 64, bias)
    assert y.requires_grad
    g = torch.randn_like(y)
    (y * g).sum().backward()
    torch.testing.assert_close(bias.grad, g.sum(0))


def test_expert_linear_rows_and_sentinels():
    E, out, inp = 3, 20, 45
    _, (p, a, s) = _packed((E, out, inp))
    cb = fmt.nf_codebook(4)
    x = torch.randn(6, inp)
    ids = torch.tensor([2, 0, 3, 2, -1, 1])  # 3 (== E) and -1 are sentinels
    y = ops.expert_linear(x, ids, p, a, s, cb, 4, inp)
    for r, e in enumerate(ids.tolist()):
        if 0 <= e < E:
            torch.testing.assert_close(y[r], reference.linear(x[r:r + 1], p[e], a[e], s[e], cb, 4, inp)[0])
        else:
            assert torch.all(y[r] == 0)


def test_kbit_linear_and_moe_compile_fullgraph(tmp_path):
    from transformers import AutoModelForCausalLM

    from kbit_hf import KbitConfig, KbitLinear, KbitMoE
    from tiny_models import tiny_model

    tiny_model("qwen3_moe", dtype=torch.float32).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cpu")
    lin = next(m for m in model.modules() if isinstance(m, KbitLinear))
    moe = next(m for m in model.modules() if isinstance(m, KbitMoE))
    x = torch.randn(5, lin.in_features)
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), lin(x))
    h = torch.randn(7, 64)
    idx = torch.randint(0, moe.num_experts, (7, 2))
    wts = torch.softmax(torch.randn(7, 2), -1)
    compiled_moe = torch.compile(moe, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled_moe(h, idx, wts), moe(h, idx, wts))
    with torch.no_grad():
        ids = torch.randint(0, 300, (1, 6))
        eager = model(ids).logits
        whole = torch.compile(model, backend="aot_eager")(ids).logits
    torch.testing.assert_close(whole, eager)


def test_expert_linear_gradient_wrt_input():
    E, out, inp = 3, 20, 45
    _, (p, a, s) = _packed((E, out, inp))
    cb = fmt.nf_codebook(4)
    x = torch.randn(7, inp, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([2, 0, 3, 2, -1, 1, 0])  # 3 (== E) and -1 are sentinels: zero rows, zero gradients
    y = ops.expert_linear(x, ids, p, a, s, cb, 4, inp)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    wd = ops.dequantize(p, a, s, cb, 4, inp, torch.float64)
    want = torch.stack([g[r] @ wd[e] if 0 <= e < E else torch.zeros(inp, dtype=torch.float64)
                        for r, e in enumerate(ids.tolist())])
    torch.testing.assert_close(x.grad, want)


def test_moe_model_backward_reaches_the_embeddings(tmp_path):
    # adapters / prompt tuning on a frozen kbit MoE: the loss's gradient flows through the quantized experts
    from transformers import AutoModelForCausalLM

    from kbit_hf import KbitConfig
    from tiny_models import VOCAB, tiny_model

    tiny_model("mixtral", dtype=torch.float32).save_pretrained(tmp_path / "fp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4),
                                                 device_map="cpu")
    emb = model.get_input_embeddings().weight
    emb.requires_grad_(True)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0
    # the same loss with the quantized weights dequantized into float modules gives the same gradient
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4),
                                                 device_map="cpu")
    plain.dequantize()
    pe = plain.get_input_embeddings().weight
    pe.requires_grad_(True)
    plain(ids, labels=ids).loss.backward()
    torch.testing.assert_close(emb.grad, pe.grad, rtol=1e-3, atol=1e-6)


def test_expert_linear_gradient_under_torch_compile():
    # traced, the backward is one opaque op (kbit::expert_linear_grad_input), not a loop unrolled over the experts
    E, out, inp = 3, 20, 45
    _, (p, a, s) = _packed((E, out, inp))
    cb = fmt.nf_codebook(4)
    ids = torch.tensor([2, 0, 3, 2, -1, 1, 0])
    x = torch.randn(7, inp, requires_grad=True)
    g = torch.randn(7, out)

    def loss(x):
        return (ops.expert_linear(x, ids, p, a, s, cb, 4, inp) * g).sum()

    loss(x).backward()
    eager = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def bw_compiler(gm, example_inputs):
        backward_ops.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward), bw_compiler=bw_compiler)
    torch.compile(loss, backend=backend, fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, eager, rtol=1e-5, atol=1e-5)
    assert backward_ops.count(torch.ops.kbit.expert_linear_grad_input.default) == 1
    assert torch.ops.kbit.dequantize.default not in backward_ops


@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
def test_custom_ops_pass_torch_opcheck(absmax_format):
    # schema, fake (meta) implementations, autograd registration and dispatcher consistency of every op
    cb = fmt.nf0_codebook(4)
    w = torch.randn(8, 40)
    p, a, s = reference.quantize(w, cb, 4, absmax_format)
    w3 = torch.randn(3, 8, 40)
    p3, a3, s3 = reference.quantize(w3, cb, 4, absmax_format)
    x = torch.randn(3, 40, requires_grad=True)
    cases = [
        (torch.ops.kbit.quantize.default, (w, cb, 4, absmax_format)),
        (torch.ops.kbit.dequantize.default, (p, a, s, cb, 4, 40, torch.bfloat16)),
        (torch.ops.kbit.linear.default, (x, p, a, s, cb, 4, 40, torch.randn(8, requires_grad=True))),
        (torch.ops.kbit.linear.default, (x.detach().bfloat16(), p, a, s, cb, 4, 40, None)),
        (torch.ops.kbit.expert_linear.default, (x, torch.tensor([0, 2, 5]), p3, a3, s3, cb, 4, 40)),
        (torch.ops.kbit.expert_linear_grad_input.default, (torch.randn(3, 8), torch.tensor([0, 2, 5]), p3, a3, s3, cb,
                                                           4, 40)),
    ]
    gd = reference.quantize(torch.randn(3, 40, 4), cb, 4, absmax_format)  # down of the [3, 8 = 2 x 4, 40] gate_up
    xb, ids2 = x.detach().bfloat16(), torch.tensor([[0, 2], [-1, 1], [2, 3]])
    wts = torch.rand(3, 2, dtype=torch.bfloat16)
    cases += [
        (torch.ops.kbit.moe_experts.default, (xb, ids2, wts, p3, a3, s3, cb, None, *gd, cb, None, 4, "silu", 0.0, 0.0)),
        (torch.ops.kbit.moe_experts.default, (xb, ids2, wts, p3, a3, s3, cb, torch.randn(3, 8), *gd, cb,
                                              torch.randn(3, 40), 4, "clamped", 1.702, 7.0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", ("qwen3", "gpt-oss"))
def test_moe_experts_op_is_the_experts_block(name, monkeypatch):
    """`kbit::moe_experts` (the reference) computes what KbitMoE's per-projection path computes with the model's own
    gating (transformers' SiLU default; gpt-oss's clamped SwiGLU with biases), sentinel ids included; KbitMoE runs
    it where the device's backend fuses (a pretended CPU backend here), not when a gradient is needed."""
    from kbit_hf.modules import fused_gating
    from tiny_models import kbit_experts

    moe = kbit_experts(name, 64, 24, 6, std=1.0)  # std 1: large enough that gpt-oss's clamps at +-7 bite
    assert moe.fused_gating == (("silu", 0.0, 0.0) if name == "qwen3" else ("clamped", 1.702, 7.0))
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 5, -1], [2, 2, 6], [1, 3, 4]])
    w = torch.rand(3, 3).softmax(-1)
    with torch.no_grad():
        expected = moe(x, ids, w)
        calls = []
        op = lambda *a: calls.append(1) or torch.ops.kbit.moe_experts(*a)  # noqa: E731
        monkeypatch.setitem(ops._MOE_EXPERTS, "cpu", (op, lambda tokens, top_k, experts, dtype: True))
        got = moe(x, ids, w)
    assert len(calls) == 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # fp32: summation order only
    moe(x.requires_grad_(), ids, w)
    moe(x.detach(), ids, w.requires_grad_())
    assert len(calls) == 1  # a gradient to carry (input, routing weights): the per-projection path
    assert fused_gating(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral", "gpt_oss"))
def test_routers_of_quantized_moe_blocks_select_through_the_op(family, tmp_path, monkeypatch):
    """Loading a MoE model quantized gives its routers the `kbit::router_topk` forward where that computes what
    theirs does; the model's logits are bitwise unchanged (on the CPU the op is the reference, torch's own ops: the
    CPU backend is pretended to have a kernel for it, which it has not, so routers are not fused there)."""
    from transformers import AutoModelForCausalLM

    from kbit_hf import KbitConfig
    from kbit_hf.modules import fuse_router, unfuse_router
    from tiny_models import tiny_model

    tiny_model(family, dtype=torch.float32).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cpu")
    assert not any(hasattr(m, "_kbit_router") for m in plain.modules())
    monkeypatch.setattr(ops, "_ROUTER_KERNELS", {"cpu"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4), device_map="cpu")
    routers = [m for m in model.modules() if hasattr(m, "_kbit_router")]
    assert len(routers) == model.config.num_hidden_layers
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        fused = model(ids).logits
        for r in routers:
            assert unfuse_router(r) and "forward" not in vars(r)  # back to the class's own forward
        own = model(ids).logits
    assert torch.equal(fused, own)
    for r in routers:
        fuse_router(r)
    model.dequantize()  # a plain float model again, routers included
    assert not any(hasattr(m, "_kbit_router") for m in model.modules())


def test_routers_with_other_semantics_keep_their_forward(monkeypatch):
    from kbit_hf.modules import fuse_router

    monkeypatch.setattr(ops, "_ROUTER_KERNELS", {"cpu"})

    class SigmoidRouter(torch.nn.Module):  # a selection router_topk does not compute
        def __init__(self):
            super().__init__()
            self.weight, self.top_k, self.hidden_dim = torch.nn.Parameter(torch.randn(8, 16)), 2, 16

        def forward(self, h):
            logits = F.linear(h, self.weight)
            w, ids = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
            return logits, w, ids

    router = SigmoidRouter()
    assert not fuse_router(router) and "forward" not in vars(router)
    assert not fuse_router(torch.nn.Linear(4, 4))


def test_router_topk_op_passes_opcheck():
    logits = torch.randn(5, 12, dtype=torch.bfloat16)
    for mode, renorm, out in (("softmax_topk", True, torch.bfloat16), ("softmax_topk", False, torch.float32),
                              ("topk_softmax", False, torch.bfloat16)):
        torch.library.opcheck(torch.ops.kbit.router_topk.default, (logits, 3, mode, renorm, out))
