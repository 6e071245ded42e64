"""The kbit op interface: torch.library custom ops `torch.ops.kbit.*`.

Each op's default implementation is the pure-PyTorch reference (kbit_hf/reference.py), valid on every device.
A compiled backend registers faster kernels for a device with `torch.library.register_kernel(op, "cuda", fn)`;
the modules only ever call the functions below, so a backend slots in without touching them. Fake (meta)
implementations let torch.compile trace the ops without running them.

Signatures (weights [..., out, in], see kbit_hf/format.py):
  quantize(weight, codebook, k, absmax_format) -> (packed, absmax, scale)
  dequantize(packed, absmax, scale, codebook, k, in_features, dtype) -> weight
  linear(x, packed, absmax, scale, codebook, k, in_features, bias?) -> x @ W^T + bias
  expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features) -> per-row expert matmul
  expert_linear_grad_input(grad, expert_ids, packed, absmax, scale, codebook, k, in_features) -> its input gradient
"""

from __future__ import annotations

import torch

from . import format as fmt
from . import reference


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


# What the modules call. Backends may add an eager fast path here (e.g. a direct ctypes launch that skips the
# custom-op dispatcher's Python overhead); under torch.compile the custom ops above are what gets traced.
# kbit_hf/cuda_backend.py sets these two when its compiled library is loaded.
_CUDA_FAST_LINEAR = None
_CUDA_FAST_EXPERT_LINEAR = None


def _eager_cuda(x) -> bool:
    # The direct path bypasses the op's autograd formula and is invisible to torch.compile: use it only for eager,
    # no-grad CUDA calls.
    return (
        x.is_cuda
        and not (x.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
    )


def linear_forward(x, packed, absmax, scale, codebook, k: int, in_features: int, bias=None):
    if _CUDA_FAST_LINEAR is not None and _eager_cuda(x):
        return _CUDA_FAST_LINEAR(x, packed, absmax, scale, codebook, k, in_features, bias)
    return torch.ops.kbit.linear(x, packed, absmax, scale, codebook, k, in_features, bias)


def expert_linear_forward(x, expert_ids, packed, absmax, scale, codebook, k: int, in_features: int):
    if _CUDA_FAST_EXPERT_LINEAR is not None and _eager_cuda(x):
        return _CUDA_FAST_EXPERT_LINEAR(x, expert_ids, packed, absmax, scale, codebook, k, in_features)
    return torch.ops.kbit.expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features)
