"""Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun) for KbitLinear layers.

transformers shards each parameter named by the model's TP plan as a DTensor before the weights load, and its
column- and row-wise hooks all-gather or all-reduce around each layer's local forward. For a kbit layer:
- column-wise (`colwise` and its variants, output rows split): the packed weight [out, blocks * k] and its block
  scales [out, blocks] split by rows, any row count;
- row-wise (`rowwise`, input columns split): they split along whole 32-weight blocks, so `in_features` must be a
  multiple of 32 x the TP size (checked here, with the layer named);
- the per-matrix scale and the codebook are replicated.
After loading, `localize` turns the layers' DTensors into the plain local shards the kernels read (in the device's
layout). MoE experts, expert parallelism, FSDP and pipeline parallelism are refused with a clear error.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .format import BLOCK
from .modules import KbitLinear, KbitMoE

REPLICATE = "replicate"  # the no-op style (transformers >= 5.23 has it; older versions get it registered here)


def tp_size(model: nn.Module) -> int:
    """The TP size this load shards over (1: no tensor parallelism); refuses the other kinds of model parallelism."""
    cfg = getattr(model.config, "distributed_config", None)
    if cfg is None:
        return int(getattr(model, "_tp_size", None) or 1)
    for field in ("ep_size", "pp_size", "dp_size", "fsdp_size"):
        if int(getattr(cfg, field, 1) or 1) > 1:
            raise NotImplementedError(f"kbit supports tensor parallelism only: distributed_config.{field}="
                                      f"{getattr(cfg, field)} (load with tp_plan and no other parallelism)")
    if getattr(cfg, "enable_expert_parallel", False):
        raise NotImplementedError("kbit does not support expert parallelism (distributed_config."
                                  "enable_expert_parallel=True): load with tp_plan only")
    return int(getattr(cfg, "tp_size", None) or getattr(model, "_tp_size", None) or 1)


def _styles():
    from transformers.distributed.tensor_parallel import (ALL_PARALLEL_STYLES, ColwiseParallel, RowwiseParallel,
                                                          TensorParallelLayer)

    if REPLICATE not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(REPLICATE, TensorParallelLayer())
    return ALL_PARALLEL_STYLES, ColwiseParallel, RowwiseParallel


def prepare_plan(model: nn.Module, size: int) -> None:
    """Check the model's TP plan against its kbit modules and replicate their scale and codebook (in place, before
    transformers shards the meta model)."""
    styles, colwise, rowwise = _styles()
    plan = model.tp_plan
    for name, module in model.named_modules():
        generic = _generic(name)
        if isinstance(module, KbitMoE):
            ruled = sorted(key for key in plan if key == generic or key.startswith(generic + "."))
            if ruled:
                raise NotImplementedError(
                    f"kbit does not support tensor parallelism over MoE experts yet: the TP plan shards {name} "
                    f"({', '.join(f'{key}: {plan[key]}' for key in ruled)}); load it on one GPU, or over several "
                    "with device_map")
            continue
        if not isinstance(module, KbitLinear):
            continue
        style_name = plan.get(generic + ".weight", plan.get(generic))
        if style_name is None:
            continue
        style = styles[style_name]
        if type(style) is rowwise:
            if module.in_features % (BLOCK * size):
                raise ValueError(
                    f"kbit cannot shard {name} row-wise ({style_name!r}) over {size} processes: in_features="
                    f"{module.in_features} is not a multiple of {BLOCK * size} (32-weight blocks x {size}), so a "
                    "shard boundary would split a block; add it to modules_to_not_convert or use another TP size")
        elif type(style) is not colwise:
            raise NotImplementedError(f"kbit cannot shard {name} with the TP style {style_name!r} "
                                      f"({type(style).__name__}); it shards column- and row-wise Linear layers only: "
                                      "add the layer to modules_to_not_convert")
        for param in ("weight", "weight_absmax"):
            plan.setdefault(f"{generic}.{param}", style_name)
        for param in ("weight_scale", "weight_codebook"):
            plan[f"{generic}.{param}"] = REPLICATE


def _generic(name: str) -> str:
    """A module name as TP plans spell it: layer numbers as `*` (model.layers.3.mlp -> model.layers.*.mlp)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _local(p: torch.Tensor) -> nn.Parameter:
    local = p.to_local() if hasattr(p, "to_local") else p.data
    out = nn.Parameter(local, requires_grad=False)
    if getattr(p, "_is_hf_initialized", False):
        out._is_hf_initialized = True
    return out


def localize(model: nn.Module) -> None:
    """Give every sharded KbitLinear its local shards as plain tensors, and record their widths."""
    for module in model.modules():
        if not isinstance(module, KbitLinear) or not hasattr(module.weight_absmax, "to_local"):
            continue
        for name in ("weight", "weight_absmax", "weight_scale", "weight_codebook"):
            setattr(module, name, _local(getattr(module, name)))
        rows, blocks = module.weight_absmax.shape
        module.local_out_features = rows
        # a row-wise shard holds whole blocks (prepare_plan), so its width is its blocks' (a column-wise one keeps
        # every input)
        module.local_in_features = module.in_features if blocks * BLOCK >= module.in_features else blocks * BLOCK
