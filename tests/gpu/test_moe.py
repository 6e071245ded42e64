"""The fused experts block (kernels.moe_experts: gate_up with the gating in its epilogue, down with the routing-weighted
sum over the top-k) against an fp64 reference, and KbitMoE's use of it."""

import functools

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf import ops
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import kernels
from .test_kernels import _quantize_on_gpu

KS = (2, 3, 4, 5)
# the relative error norm of the block: weights reach the MMA rounded to the activation dtype (cb and the block scale
# each rounded, their product once more), the gated activations are rounded once, fp32 accumulation; a dropped block,
# a wrong expert or a wrong gate / up row gives errors of 10-100%
REL_NORM = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8}


@functools.lru_cache(maxsize=32)  # the dtype and gate of a test change faster than its block's weights
def _quantized_block(E, hidden, inter, out_f, k, seed, biases):
    g = torch.Generator().manual_seed(seed)
    cb = fmt.nf_codebook(k)
    gu = _quantize_on_gpu(torch.randn(E, 2 * inter, hidden, generator=g) * 0.1, cb, k,
                          "e4m4" if seed % 2 else "fp16")
    dn = _quantize_on_gpu(torch.randn(E, out_f, inter, generator=g) * 0.1, cb, k, "e4m4")
    gb = torch.randn(E, 2 * inter, generator=g) if biases else None
    db = torch.randn(E, out_f, generator=g) if biases else None
    return g.get_state(), cb, gu, dn, gb, db


def _block(E, hidden, inter, out_f, k, seed, biases):
    """A block's quantized experts (and biases), and a generator in the state their draws left (cached)."""
    state, *block = _quantized_block(E, hidden, inter, out_f, k, seed, biases)
    g = torch.Generator()
    g.set_state(state)
    return (g, *block)


def _ref64(x, ids, w, gu, dn, gb, db, cb, k, gate, alpha, limit, dtype):
    """fp64 block, with the gated activations rounded to the activation dtype as the kernel stores them; computed on
    the GPU, returned on the host."""
    x, ids, w, gb, db, cb = (None if t is None else t.cuda() for t in (x, ids, w, gb, db, cb))
    E, hidden, inter = gu[0].shape[0], x.shape[1], gu[0].shape[1] // 2
    wgu = reference.dequantize(*(t.cuda() for t in gu), cb, k, hidden, torch.float32).double()
    wd = reference.dequantize(*(t.cuda() for t in dn), cb, k, inter, torch.float32).double()
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    safe = flat.clamp(0, E - 1)
    xr = x.double().repeat_interleave(ids.shape[1], dim=0)
    gsum = torch.einsum("ni,noi->no", xr, wgu[safe])
    if gb is not None:
        gsum = gsum + gb.to(dtype).double()[safe]
    h = reference.gate_activation(gsum, gate, alpha, limit).to(dtype).double() * valid.unsqueeze(-1)
    d = torch.einsum("ni,noi->no", h, wd[safe])
    if db is not None:
        d = d + db.to(dtype).double()[safe]
    wr = w.reshape(-1, 1).to(dtype).double() * valid.unsqueeze(-1)
    return (d * wr).view(*ids.shape, -1).sum(1).cpu(), h.cpu()


def _rel(got, ref):
    return ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("gate", ("silu", "clamped"))
@pytest.mark.parametrize("tokens", ((1, 8), (2, 4), (4, 2), (3, 3)), ids=str)  # (T, top_k)
@pytest.mark.parametrize("shape", ((136, 40, 136), (100, 37, 100), (2080, 96, 2080), (256, 768, 256), (64, 248, 72)),
                         ids=str)
def test_moe_experts(k, dtype, gate, tokens, shape):
    """(hidden, intermediate, out): partial blocks and tiles (100 / 37), rows of more than 8 steps in gate_up (2080),
    of several steps per expert in down (768), and a down step whose last block is partial (248: 8 blocks, the last
    of 24 columns). Ids include -1 and E (expert-parallel sentinels); h and y are poisoned before the call; biases
    with the clamped gating and on the 100-wide block with SiLU."""
    T, top_k = tokens
    hidden, inter, out_f = shape
    E = 6
    g, cb, gu, dn, gb, db = _block(E, hidden, inter, out_f, k, seed=T * 100 + k + hidden,
                                   biases=gate == "clamped" or hidden == 100)
    x = torch.randn(T, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:top_k] - 1 for _ in range(T)])  # -1 .. E
    w = torch.rand(T, top_k, generator=g).softmax(-1).to(dtype)
    alpha, limit = (1.702, 7.0) if gate == "clamped" else (0.0, 0.0)
    ref, href = _ref64(x, ids, w, gu, dn, gb, db, cb, k, gate, alpha, limit, dtype)
    h = torch.full((T * top_k, inter), float("nan"), dtype=dtype, device="cuda")
    y = torch.full((T, out_f), float("nan"), dtype=dtype, device="cuda")
    cu = lambda t: None if t is None else t.cuda()  # noqa: E731
    kernels.moe_experts_out(x.cuda(), ids.cuda(), w.cuda(), tuple(map(cu, gu + (cb,))), cu(gb),
                            tuple(map(cu, dn + (cb,))), cu(db), k, gate, alpha, limit, h, y)
    valid = ((ids >= 0) & (ids < E)).reshape(-1)
    assert bool((h[~valid.cuda()] == 0).all()), "rows of sentinel ids must be zero"
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(h).all())
    assert _rel(h[valid.cuda()], href[valid]) <= REL_NORM[dtype]
    assert _rel(y, ref) <= REL_NORM[dtype]


def test_moe_experts_in_a_cuda_graph():
    """Captures (no host sync) and, replayed on new routing, weights and activations, matches eager bitwise."""
    k, E, hidden, inter, T, top_k = 4, 8, 256, 96, 2, 4
    _, cb, gu, dn, _, _ = _block(E, hidden, inter, hidden, k, seed=1, biases=False)
    gu, dn, cb = tuple(t.cuda() for t in gu), tuple(t.cuda() for t in dn), cb.cuda()
    x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(T, top_k, dtype=torch.int64, device="cuda")
    w = torch.rand(T, top_k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(T, hidden, device="cuda", dtype=torch.bfloat16)
    args = lambda: (x, ids, w, *gu, cb, None, *dn, cb, None, k, "silu", 0.0, 0.0)  # noqa: E731

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y.copy_(kernels.moe_experts(*args()))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(kernels.moe_experts(*args()))
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        ids.copy_(torch.stack([torch.randperm(E + 1, device="cuda", generator=g)[:top_k] for _ in range(T)]))
        w.copy_(torch.rand(w.shape, device="cuda", generator=g))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernels.moe_experts(*args())), seed


def test_moe_experts_refuses_bad_input():
    k, E, hidden, inter = 4, 3, 64, 32
    _, cb, gu, dn, _, _ = _block(E, hidden, inter, hidden, k, seed=2, biases=False)
    gu, dn, cb = tuple(t.cuda() for t in gu), tuple(t.cuda() for t in dn), cb.cuda()
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int64, device="cuda")
    w = torch.ones(1, 2, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gelu"):
        kernels.moe_experts(x, ids, w, *gu, cb, None, *dn, cb, None, k, "gelu", 0.0, 0.0)
    with pytest.raises(ValueError, match="down_bias has shape"):
        kernels.moe_experts(x, ids, w, *gu, cb, None, *dn, cb, torch.zeros(E, 7, device="cuda"), k, "silu", 0.0, 0.0)
    with pytest.raises(ValueError, match="top_k_weights has shape"):
        kernels.moe_experts(x, ids, w[:, :1], *gu, cb, None, *dn, cb, None, k, "silu", 0.0, 0.0)
    y = kernels.moe_experts(x.float(), ids, w.float(), *gu, cb, None, *dn, cb, None, k, "silu", 0.0, 0.0)
    assert y.dtype == torch.float32  # fp32 activations: the reference


@pytest.mark.parametrize("name", ("qwen3", "gpt-oss"))
def test_kbit_moe_runs_the_fused_block(name, monkeypatch):
    """KbitMoE of a real transformers experts class (Qwen3-MoE: SiLU gating; gpt-oss: clamped SwiGLU, biases,
    transposed weights) runs the fused block at batch 1, eager and under torch.compile(fullgraph=True) (one op, no
    graph break: bitwise the eager result), and matches its own per-projection path."""
    from tiny_models import kbit_experts

    moe = kbit_experts(name, 256 if name == "qwen3" else 320, 96 if name == "qwen3" else 160,
                       16 if name == "qwen3" else 8, std=0.05, device="cuda", dtype=torch.bfloat16)
    E, top_k = moe.num_experts, 4
    x = torch.randn(1, moe.in_features["gate_up_proj"], device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[3, -1, 0, E - 1]], device="cuda")
    w = torch.rand(1, top_k, device="cuda").softmax(-1).to(torch.bfloat16)
    calls = []
    fused, fuses = ops._MOE_EXPERTS["cuda"]
    monkeypatch.setitem(ops._MOE_EXPERTS, "cuda", (lambda *a: calls.append(1) or fused(*a), fuses))
    with torch.no_grad():
        y = moe(x, ids, w)
        assert len(calls) == 1
        y_compiled = torch.compile(moe, fullgraph=True)(x, ids, w)
        monkeypatch.setitem(ops._MOE_EXPERTS, "cuda", (fused, lambda tokens, top_k, experts, dtype: False))
        y_unfused = moe(x, ids, w)
    assert torch.equal(y_compiled, y)
    assert _rel(y, y_unfused.double().cpu()) <= 2.0**-6


_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-22}


@pytest.mark.parametrize("mode,renorm", (("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("E,k", ((8, 2), (37, 5), (128, 8), (32, 4), (2048, 32), (5, 5), (64, 1)), ids=str)
@pytest.mark.parametrize("T", (1, 6, 300))
def test_router_topk(mode, renorm, dtype, E, k, T):
    """The selection kernel against torch's ops (reference.router_topk) on random logits: the same ids in the same
    order (on tokens without equal logits among their k + 1 largest, where the order of equals is the kernels'
    choice), weights within two roundings of the dtype they are rounded to; outputs in the logits' dtype and fp32."""
    g = torch.Generator(device="cuda").manual_seed(E * 1000 + k * 10 + T)
    logits = (torch.randn(T, E, device="cuda", generator=g) * 3).to(dtype)
    top = logits.float().topk(min(k + 1, E), dim=-1).values
    distinct = (top[:, 1:] != top[:, :-1]).all(dim=-1)
    for out_dtype in (dtype, torch.float32):
        w, ids = kernels.router_topk(logits, k, mode, renorm, out_dtype)
        rw, rids = reference.router_topk(logits, k, mode, renorm, out_dtype)
        assert w.dtype == out_dtype and ids.dtype == torch.int64
        assert torch.equal(ids[distinct], rids[distinct])
        # top-k first: the softmax is rounded to the logits' dtype before the output dtype
        ulp = max(_ULP[out_dtype], _ULP[dtype]) if mode == "topk_softmax" else _ULP[out_dtype]
        torch.testing.assert_close(w.float().sort(-1).values, rw.float().sort(-1).values, rtol=2 * ulp, atol=1e-6)


def test_router_topk_ties_and_limits():
    """Equal logits go to the lower expert id first; past the kernel's limits (E > 2048, k > 32) the reference runs."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]], device="cuda")
    w, ids = kernels.router_topk(logits, 3, "softmax_topk", True, torch.float32)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(w, torch.full((1, 3), 1 / 3, device="cuda"))
    big = torch.randn(3, 3000, device="cuda")
    w, ids = kernels.router_topk(big, 40, "softmax_topk", False, torch.float32)
    rw, rids = reference.router_topk(big, 40, "softmax_topk", False, torch.float32)
    assert torch.equal(ids, rids) and torch.equal(w, rw)
