"""Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun) for KbitLinear and KbitMoE.

transformers shards each parameter named by the model's TP plan as a DTensor before the weights load, and its
column- and row-wise hooks all-gather or all-reduce around each layer's local forward. For a kbit layer:
- column-wise (`colwise` and its variants, output rows split): the packed weight [out, blocks * k] and its block
  scales [out, blocks] split by rows, any row count;
- row-wise (`rowwise`, input columns split): they split along whole 32-weight blocks, so `in_features` must be a
  multiple of 32 x the TP size (checked here, with the layer named);
- the per-matrix scale and the codebook are replicated.
MoE experts (KbitMoE) shard the same way, every expert at once: gate_up by rows (the gate and up halves each split,
`packed_colwise`), down by whole input blocks; transformers' experts hook sums the processes' outputs. After loading,
`localize` turns the DTensors into the plain local shards the kernels read (in the device's layout). Experts stored
transposed (gpt-oss), expert parallelism, FSDP and pipeline parallelism are refused with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

from .format import BLOCK
from .modules import COMPANIONS, KbitLinear, KbitMoE, local_view

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
    from transformers.distributed import tensor_parallel as tp

    if REPLICATE not in tp.ALL_PARALLEL_STYLES:
        tp.ALL_PARALLEL_STYLES.register(REPLICATE, tp.TensorParallelLayer())
    return tp


def _plan(model: nn.Module) -> tuple[dict, dict]:
    """The TP plan transformers will apply, and the dict kbit's entries go into. A user's `tp_plan` dict is merged
    over the model's plan after this hook runs (transformers >= 5.23), so the entries, written with the merged
    plan's styles, carry over; before 5.23 the dict replaces the plan wholesale, entries and all."""
    plan = model.tp_plan
    override = getattr(getattr(model.config, "distributed_config", None), "tp_plan", None)
    if not isinstance(override, dict) or not override:
        return plan, plan
    if not hasattr(model, "_resolve_parallel_plans"):
        raise NotImplementedError("kbit's tensor parallel takes tp_plan='auto' on transformers < 5.23: a tp_plan dict "
                                  "there replaces the plan after the quantizer has added its entries for the packed "
                                  "tensors' scales (the model's own plan, or a newer transformers, works)")
    return {**plan, **override}, plan


def prepare_plan(model: nn.Module, size: int) -> None:
    """Check the TP plan against the model's kbit modules and give their companions plan entries (before transformers
    shards the meta model): block scales follow their weight, the scale and the codebook are replicated. Styles
    that leave the weight whole (e.g. `mla_kv_a_proj`) need nothing."""
    tp = _styles()
    styles = tp.ALL_PARALLEL_STYLES
    plan, target = _plan(model)
    for name, module in model.named_modules():
        generic = tp.replace_layer_number_by_wildcard(name)  # model.layers.3.mlp -> model.layers.*.mlp
        skip_hint = (f"add {name!r} to modules_to_not_convert (it then stays in full precision and transformers "
                     "shards it)")
        if isinstance(module, KbitLinear):
            weights = {"weight": (name, module.in_features)}
        elif isinstance(module, KbitMoE):
            ruled = sorted(key for key in plan if key == generic or key.startswith(generic + "."))
            if not ruled:
                continue
            rules = ", ".join(f"{key}: {plan[key]}" for key in ruled)
            if module.is_transposed:
                raise NotImplementedError(f"kbit cannot shard {name} for tensor parallelism: its experts are stored "
                                          f"transposed ({module._orig_cls.__name__}; TP plan: {rules}); {skip_hint}")
            hook = plan.get(generic)
            if hook is None or type(styles[hook]) is not tp.MoeExpertsParallel:
                # without transformers' experts hook nobody sums the processes' partial outputs
                raise NotImplementedError(f"kbit cannot shard {name} for tensor parallelism: the TP plan shards its "
                                          f"projections without the experts hook 'moe_tp_experts' on the module "
                                          f"({rules}); {skip_hint}")
            weights = {proj: (f"{name}.{proj}", module.in_features[proj]) for proj in module.quantized_names}
        else:
            continue
        for param, (what, in_features) in weights.items():
            style_name = plan.get(f"{generic}.{param}", plan.get(generic) if isinstance(module, KbitLinear) else None)
            if style_name is None and isinstance(module, KbitMoE):
                raise NotImplementedError(f"kbit cannot shard {name} for tensor parallelism: the TP plan has no rule "
                                          f"for {what} (each projection needs one); {skip_hint}")
            if style_name is None or type(styles[style_name]).shard_param is tp.TensorParallelLayer.shard_param:
                continue  # the weight stays whole on every process
            style = type(styles[style_name])
            if style is tp.RowwiseParallel:
                if in_features % (BLOCK * size):
                    raise ValueError(
                        f"kbit cannot shard {what} row-wise ({style_name!r}) over {size} processes: in_features="
                        f"{in_features} is not a multiple of {BLOCK * size} (32-weight blocks x {size}), so a shard "
                        f"boundary would split a block; {skip_hint}, or use another TP size")
            elif param == "gate_up_proj" and style is not tp.PackedColwiseParallel:
                raise NotImplementedError(f"kbit cannot shard {what} with the TP style {style_name!r}: a contiguous "
                                          "split puts the gate and up halves on different processes "
                                          f"('packed_colwise' keeps both on each); {skip_hint}")
            elif style not in (tp.ColwiseParallel, tp.PackedColwiseParallel):
                raise NotImplementedError(f"kbit cannot shard {what} with the TP style {style_name!r} "
                                          f"({style.__name__}): it shards weights by output rows or by whole input "
                                          f"blocks only; {skip_hint}")
            entries = {f"{generic}.{param}": style_name, f"{generic}.{param}_absmax": style_name,
                       f"{generic}.{param}_scale": REPLICATE, f"{generic}.{param}_codebook": REPLICATE}
            target.update(entries)


def _local(p: torch.Tensor) -> nn.Parameter:
    out = nn.Parameter(local_view(p).detach(), requires_grad=False)
    if getattr(p, "_is_hf_initialized", False):
        out._is_hf_initialized = True
    return out


def _packed_dtensor(packed: torch.Tensor, absmax: torch.Tensor, k: int) -> nn.Parameter:
    """The packed weight as a DTensor of its true global shape: an on-the-fly load wraps the packed shard in the
    float placeholder's metadata ([E, out, in] of floats)."""
    from torch.distributed.tensor import DTensor

    shape = (*absmax.shape[:-1], absmax.shape[-1] * k)
    stride = torch.empty(shape, device="meta").stride()
    out = nn.Parameter(DTensor.from_local(packed.to_local(), packed.device_mesh, packed.placements, run_check=False,
                                          shape=shape, stride=stride), requires_grad=False)
    out._is_hf_initialized = getattr(packed, "_is_hf_initialized", False)
    return out


def localize(model: nn.Module) -> None:
    """After loading: every sharded KbitLinear gets its local shards as plain tensors (the kernels read them, in the
    device's layout), and every sharded module records its widths. A row-wise shard holds whole blocks
    (prepare_plan), so its input width is its blocks'; a column-wise one keeps every input. The experts keep their
    DTensors (transformers' hooks hand their forward the local parts): transformers 5.17's experts hook sums the
    processes' outputs only when it sees sharded DTensor parameters."""
    for module in model.modules():
        if isinstance(module, KbitLinear):
            if not hasattr(module.weight_absmax, "to_local"):
                continue
            for suffix in ("",) + COMPANIONS:
                setattr(module, "weight" + suffix, _local(getattr(module, "weight" + suffix)))
            module.local_out_features = module.weight_absmax.shape[0]
            module.local_in_features = min(module.in_features, module.weight_absmax.shape[-1] * BLOCK)
            module.is_shard = True  # on every process alike (the same modules are sharded everywhere)
        elif isinstance(module, KbitMoE):
            for n in module.quantized_names:
                absmax = getattr(module, n + "_absmax")
                if hasattr(absmax, "to_local"):
                    setattr(module, n, _packed_dtensor(getattr(module, n), absmax, module.k))
                    module.in_features[n] = min(module.in_features[n], absmax.to_local().shape[-1] * BLOCK)
                    module.is_shard = True
