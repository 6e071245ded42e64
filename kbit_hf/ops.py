"""The kbit op interface: the `torch.ops.kbit.*` custom ops, and the one place where backends plug in.

The modules (kbit_hf/modules.py) call only the functions of this file. Each op's default implementation is the
pure-PyTorch reference (kbit_hf/backends/reference.py), valid on every device; a backend adds faster
implementations for a device type with `register_backend`, and in-memory weight layouts with `register_layout`.
Fake (meta) implementations let torch.compile trace the ops without running them.

Signatures (weights [..., out, in], see kbit_hf/format.py):
  quantize(weight, codebook, k, absmax_format) -> (packed, absmax, scale)
  dequantize(packed, absmax, scale, codebook, k, in_features, dtype) -> weight
  linear(x, packed, absmax, scale, codebook, k, in_features, bias?) -> x @ W^T + bias
  expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features) -> per-row expert matmul
  expert_linear_grad_input(grad, expert_ids, packed, absmax, scale, codebook, k, in_features) -> its input gradient
  moe_experts(x, top_k_index, top_k_weights, gate_up..., down..., k, gate, alpha, limit) -> a whole experts block
  router_topk(logits, k, mode, renorm, out_dtype) -> (weights, ids) of a MoE router
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from . import format as fmt
from .backends import reference


@torch.library.custom_op("kbit::quantize", mutates_args=())
def quantize(
    weight: torch.Tensor, codebook: torch.Tensor, k: int, absmax_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.quantize(weight, codebook, k, absmax_format)


@quantize.register_fake
def _(weight, codebook, k, absmax_format):
    return fmt.empty_quantized(tuple(weight.shape), k, absmax_format, weight.device)


@torch.library.custom_op("kbit::dequantize", mutates_args=())
def dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return reference.dequantize(packed, absmax, scale, codebook, k, in_features, dtype)


@dequantize.register_fake
def _(packed, absmax, scale, codebook, k, in_features, dtype):
    return packed.new_empty((*packed.shape[:-1], in_features), dtype=dtype)


@torch.library.custom_op("kbit::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return reference.linear(x, packed, absmax, scale, codebook, k, in_features, bias)


@linear.register_fake
def _(x, packed, absmax, scale, codebook, k, in_features, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[-2]))


def _linear_setup_context(ctx, inputs, output):
    x, packed, absmax, scale, codebook, k, in_features, bias = inputs
    ctx.save_for_backward(packed, absmax, scale, codebook)
    ctx.k, ctx.in_features, ctx.x_dtype, ctx.has_bias = k, in_features, x.dtype, bias is not None


def _linear_backward(ctx, grad):
    # Gradient w.r.t. the input only (for adapters such as LoRA); packed weights are frozen.
    packed, absmax, scale, codebook = ctx.saved_tensors
    w = dequantize(packed, absmax, scale, codebook, ctx.k, ctx.in_features, grad.dtype)
    grad_x = (grad @ w).to(ctx.x_dtype)
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return grad_x, None, None, None, None, None, None, grad_bias


linear.register_autograd(_linear_backward, setup_context=_linear_setup_context)


@torch.library.custom_op("kbit::expert_linear", mutates_args=())
def expert_linear(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
) -> torch.Tensor:
    return reference.expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features)


@expert_linear.register_fake
def _(x, expert_ids, packed, absmax, scale, codebook, k, in_features):
    return x.new_empty((x.shape[0], packed.shape[-2]))


@torch.library.custom_op("kbit::expert_linear_grad_input", mutates_args=())
def expert_linear_grad_input(
    grad: torch.Tensor,
    expert_ids: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
) -> torch.Tensor:
    """expert_linear's gradient w.r.t. its input: row r is grad[r] @ W[expert_ids[r]]; rows of ids outside [0, E)
    (zero outputs) get zero rows. One expert's weight is dequantized at a time, only for the experts present (one
    host sync), or for every expert, masked, while a CUDA graph is being captured (no sync allowed). An op of its own,
    so that torch.compile records one node instead of unrolling a loop over every expert."""
    grad_x = grad.new_zeros((grad.shape[0], in_features))
    E = packed.shape[0]
    if grad.is_cuda and torch.cuda.is_current_stream_capturing():
        for e in range(E):
            w = dequantize(packed[e], absmax[e], scale[e], codebook, k, in_features, grad.dtype)
            grad_x = grad_x + (grad * (expert_ids == e).unsqueeze(-1).to(grad.dtype)) @ w
        return grad_x
    for e, rows in reference.rows_by_expert(expert_ids, E):
        w = dequantize(packed[e], absmax[e], scale[e], codebook, k, in_features, grad.dtype)
        grad_x[rows] = grad[rows] @ w
    return grad_x


@expert_linear_grad_input.register_fake
def _(grad, expert_ids, packed, absmax, scale, codebook, k, in_features):
    return grad.new_empty((grad.shape[0], in_features))


def _expert_linear_setup_context(ctx, inputs, output):
    x, expert_ids, packed, absmax, scale, codebook, k, in_features = inputs
    ctx.save_for_backward(expert_ids, packed, absmax, scale, codebook)
    ctx.k, ctx.in_features, ctx.x_dtype = k, in_features, x.dtype


def _expert_linear_backward(ctx, grad):
    # Gradient w.r.t. the input only (adapters on a frozen MoE); packed weights are frozen.
    expert_ids, packed, absmax, scale, codebook = ctx.saved_tensors
    grad_x = expert_linear_grad_input(grad, expert_ids, packed, absmax, scale, codebook, ctx.k, ctx.in_features)
    return grad_x.to(ctx.x_dtype), None, None, None, None, None, None, None


expert_linear.register_autograd(_expert_linear_backward, setup_context=_expert_linear_setup_context)


@torch.library.custom_op("kbit::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_packed: torch.Tensor,
    gate_up_absmax: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_codebook: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_packed: torch.Tensor,
    down_absmax: torch.Tensor,
    down_scale: torch.Tensor,
    down_codebook: torch.Tensor,
    down_bias: torch.Tensor | None,
    k: int,
    gate: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """A whole MoE experts block [T, H] -> [T, H_out] with its gating ("silu" or "clamped": reference.gate_activation)
    and the routing-weighted sum over the top-k: what a backend fuses for few tokens (inference only)."""
    return reference.moe_experts(x, top_k_index, top_k_weights,
                                 (gate_up_packed, gate_up_absmax, gate_up_scale, gate_up_codebook), gate_up_bias,
                                 (down_packed, down_absmax, down_scale, down_codebook), down_bias, k, gate, alpha,
                                 limit)


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_scale, gate_up_codebook, gate_up_bias,
      down_packed, down_absmax, down_scale, down_codebook, down_bias, k, gate, alpha, limit):
    return x.new_empty((x.shape[0], down_packed.shape[1]))


@torch.library.custom_op("kbit::router_topk", mutates_args=())
def router_topk(logits: torch.Tensor, k: int, mode: str, renorm: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router's routing weights and expert ids from its logits (reference.router_topk)."""
    return reference.router_topk(logits, k, mode, renorm, out_dtype)


@router_topk.register_fake
def _(logits, k, mode, renorm, out_dtype):
    shape = (*logits.shape[:-1], k)
    return logits.new_empty(shape, dtype=out_dtype), logits.new_empty(shape, dtype=torch.int64)


def has_router_kernel(device: torch.device) -> bool:
    """The backend of `device` runs `kbit::router_topk` as a kernel of its own."""
    return device.type in _ROUTER_KERNELS


def router_topk_in_torch(logits, k: int, mode: str, renorm: bool, out_dtype: torch.dtype):
    """`router_topk`'s semantics in torch's own ops on any device: bitwise what a transformers router with that
    selection computes (what KbitMoE's routers are probed against)."""
    return reference.router_topk(logits, k, mode, renorm, out_dtype)


# ---- backends --------------------------------------------------------------------------------------------------

_OPS = {"quantize": quantize, "dequantize": dequantize, "linear": linear, "expert_linear": expert_linear,
        "moe_experts": moe_experts, "router_topk": router_topk}
# device type -> direct callables for eager, no-grad calls (they skip the dispatcher's Python cost; under
# torch.compile or autograd the custom ops above are what runs)
_EAGER_LINEAR: dict[str, Callable] = {}
_EAGER_EXPERT_LINEAR: dict[str, Callable] = {}
# device type -> (the fused experts block, whether it runs for (tokens, top_k, experts, dtype)); devices without one
# run KbitMoE's per-projection path
_MOE_EXPERTS: dict[str, tuple[Callable, Callable]] = {}
# device types whose backend has a kernel for `kbit::router_topk` (elsewhere the op is torch's own ops, no faster)
_ROUTER_KERNELS: set[str] = set()


def register_backend(device_type: str, *, quantize: Callable, dequantize: Callable, linear: Callable,
                     expert_linear: Callable, eager_linear: Callable | None = None,
                     eager_expert_linear: Callable | None = None, moe_experts: Callable | None = None,
                     fuses_moe: Callable | None = None, router_topk: Callable | None = None) -> None:
    """Make a backend's implementations the ops' kernels for tensors on `device_type` ("cuda", "cpu", ...).

    Each callable has its op's signature. `eager_linear` / `eager_expert_linear` are optional direct paths that
    `linear_forward` / `expert_linear_forward` call for eager inference (no autograd, not compiling). `moe_experts`
    (the `kbit::moe_experts` op's kernel) with `fuses_moe(tokens, top_k, experts, dtype)`: the calls for which
    KbitMoE runs it. `router_topk`: the `kbit::router_topk` op's kernel."""
    for name, fn in (("quantize", quantize), ("dequantize", dequantize), ("linear", linear),
                     ("expert_linear", expert_linear)):
        torch.library.register_kernel(_OPS[name], device_type, fn)
    for table, fn in ((_EAGER_LINEAR, eager_linear), (_EAGER_EXPERT_LINEAR, eager_expert_linear)):
        if fn is None:
            table.pop(device_type, None)
        else:
            table[device_type] = fn
    if moe_experts is None or fuses_moe is None:
        _MOE_EXPERTS.pop(device_type, None)
    else:
        torch.library.register_kernel(_OPS["moe_experts"], device_type, moe_experts)
        _MOE_EXPERTS[device_type] = (moe_experts, fuses_moe)
    if router_topk is None:
        _ROUTER_KERNELS.discard(device_type)
    else:
        torch.library.register_kernel(_OPS["router_topk"], device_type, router_topk)
        _ROUTER_KERNELS.add(device_type)


def _device_type(x) -> str:
    # x.is_cuda / x.is_cpu are cheaper than building x.device: this runs once per layer and token
    return "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type


def _eager(x, bias=None) -> bool:
    # The direct path bypasses the op's autograd formula (x's and a trained bias's gradients) and is invisible to
    # torch.compile.
    needs_grad = x.requires_grad or (bias is not None and bias.requires_grad)
    return not (needs_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling()


def linear_forward(x, packed, absmax, scale, codebook, k: int, in_features: int, bias=None):
    """What KbitLinear.forward runs: a backend's eager path where it has one, else the `kbit::linear` op."""
    fast = _EAGER_LINEAR.get(_device_type(x))
    if fast is not None and _eager(x, bias):
        return fast(x, packed, absmax, scale, codebook, k, in_features, bias)
    return torch.ops.kbit.linear(x, packed, absmax, scale, codebook, k, in_features, bias)


def expert_linear_forward(x, expert_ids, packed, absmax, scale, codebook, k: int, in_features: int):
    """What KbitMoE runs per projection: a backend's eager path where it has one, else the `kbit::expert_linear` op."""
    fast = _EAGER_EXPERT_LINEAR.get(_device_type(x))
    if fast is not None and _eager(x):
        return fast(x, expert_ids, packed, absmax, scale, codebook, k, in_features)
    return torch.ops.kbit.expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features)


def fuses_moe(x, tokens: int, top_k: int, experts: int, *others) -> bool:
    """The backend of x's device runs a whole experts block of `tokens` x `top_k` rows over `experts` experts as
    `kbit::moe_experts`. Inference only: the op has no autograd formula, so not while x or any of `others` (the
    routing weights, biases) needs a gradient."""
    entry = _MOE_EXPERTS.get(_device_type(x))
    if entry is None or not entry[1](tokens, top_k, experts, x.dtype):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *others)))


def moe_experts_forward(x, top_k_index, top_k_weights, gate_up: tuple, gate_up_bias, down: tuple, down_bias, k: int,
                        gate: str, alpha: float, limit: float):
    """What KbitMoE runs where `fuses_moe`: the backend's kernel directly in eager mode, else the op."""
    args = (x, top_k_index, top_k_weights, *gate_up, gate_up_bias, *down, down_bias, k, gate, alpha, limit)
    if not torch.compiler.is_compiling():
        return _MOE_EXPERTS[_device_type(x)][0](*args)
    return torch.ops.kbit.moe_experts(*args)


# ---- in-memory layouts -----------------------------------------------------------------------------------------
# A checkpoint always holds the bit planes of kbit_hf/format.py. A backend may hold a weight in another layout on
# its device (same bytes, permuted for its kernels); its ops then accept that layout, and modules convert with the
# two functions below when a weight is loaded, moved or saved.


class Layout(Protocol):
    name: str  # what KbitLinear.extra_repr shows

    def holds(self, packed: torch.Tensor) -> bool:
        """`packed` is in this layout."""

    def wants(self, out_features: int, in_features: int, k: int, absmax_format: str, device: torch.device) -> bool:
        """A weight of this shape and format is held in this layout on `device`."""

    def from_planes(self, packed, absmax, in_features: int, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def to_planes(self, packed, absmax, in_features: int, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


_LAYOUTS: list[Layout] = []


def register_layout(layout: Layout) -> None:
    """Add an in-memory layout (one per name: registering a name again replaces it)."""
    _LAYOUTS[:] = [known for known in _LAYOUTS if known.name != layout.name] + [layout]


def bit_planes(packed, absmax, in_features: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, absmax) in the checkpoint layout (bit planes), whatever layout they are held in."""
    layout = _layout_of(packed)
    return (packed, absmax) if layout is None else layout.to_planes(packed, absmax, in_features, k)


def device_layout(packed, absmax, out_features: int, in_features: int, k: int, absmax_format: str):
    """(packed, absmax) in the layout the backends want for this weight on its current device (bit planes unless a
    registered layout wants it)."""
    packed, absmax = bit_planes(packed, absmax, in_features, k)
    for layout in _LAYOUTS:
        if layout.wants(out_features, in_features, k, absmax_format, packed.device):
            return layout.from_planes(packed, absmax, in_features, k)
    return packed, absmax


def layout_like(like, packed, absmax, in_features: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, absmax), given as bit planes, in the layout `like` is held in."""
    layout = _layout_of(like)
    return (packed, absmax) if layout is None else layout.from_planes(packed, absmax, in_features, k)


def layout_name(packed) -> str:
    """The name of the layout `packed` is held in ("bit planes" for the checkpoint layout)."""
    layout = _layout_of(packed)
    return "bit planes" if layout is None else layout.name


def _layout_of(packed):
    """The registered layout `packed` is held in; None for the bit planes."""
    return next((layout for layout in _LAYOUTS if layout.holds(packed)), None)
