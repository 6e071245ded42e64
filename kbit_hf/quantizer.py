"""KbitHfQuantizer: plugs kbit into `from_pretrained` (transformers 5.17 .. 5.x).

On-the-fly: `_process_model_before_weight_loading` swaps nn.Linear -> KbitLinear and fused experts -> KbitMoE on
the meta model; the loader then streams one checkpoint tensor (or one fused experts tensor) at a time through
`KbitQuantize`, which returns the packed tensors. Pre-quantized: the same modules are built with packed-shape
placeholders and the checkpoint loads by name. docs/design.md lists the hooks used.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert
from transformers.utils import logging

from . import format as fmt
from . import tensor_parallel
from .config import KbitConfig, matches_module
from .modules import (COMPANIONS, KbitLinear, KbitMoE, fuse_router, fuse_siblings, is_fused_experts, local_view,
                      modules_outside, refuse_shard, unfuse_router)

logger = logging.get_logger(__name__)

# Leaf names of MoE routers / gates that are nn.Linear in some families; they stay in full precision.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def _module_of(model: nn.Module, param_name: str) -> tuple[nn.Module, str]:
    module_name, _, tensor_name = param_name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), tensor_name


class KbitQuantize(ConversionOps):
    """Loader op: one float checkpoint tensor in, its packed kbit tensors out."""

    def __init__(self, hf_quantizer: "KbitHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], source_patterns=None, target_patterns=None, *,
                full_layer_name: str | None = None, model=None, config=None, missing_keys=None, **kwargs):
        (target, value), = input_dict.items()
        value = value[0] if isinstance(value, (list, tuple)) else value
        module, name = _module_of(model, target)
        prefix = target[: -len(name)]
        # transformers turns an exception raised here into a generic "conversion" RuntimeError after a load report
        # that repeats the traceback per tensor (core_model_loading.log_conversion_errors), so a non-finite tensor is
        # recorded instead and _process_model_after_weight_loading raises kbit's error before anything is returned
        problem = _nonfinite_problem(target, value, isinstance(module, KbitMoE))
        if problem is not None:
            self.hf_quantizer.nonfinite_tensors.append(problem)
        if self.hf_quantizer.nonfinite_tensors:  # the load will fail: check the rest, quantize nothing more
            return {prefix + key: tensor for key, tensor in _empty_outputs(module, name, value).items()}
        return {prefix + key: tensor for key, tensor in module.quantize_param(name, value).items()}


class KbitHfQuantizer(HfQuantizer):
    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        # what is wrong with each float checkpoint tensor that holds NaN/Inf values (filled by KbitQuantize)
        self.nonfinite_tensors: list[str] = []

    # ---- environment and placement -------------------------------------------------------------------------
    def validate_environment(self, *args, device_map=None, **kwargs):
        if isinstance(device_map, dict) and not self.pre_quantized and "disk" in device_map.values():
            raise ValueError(
                "kbit cannot quantize on the fly into disk-offloaded modules: quantize and save the model first "
                "(device_map without 'disk'), then load that folder with disk offload."
            )

    def update_device_map(self, device_map):
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}
            logger.info("kbit: no device_map given, placing the model on cuda:%d", torch.cuda.current_device())
        return device_map

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, name = _module_of(model, param_name)
        if isinstance(module, KbitLinear):
            return name == "weight"
        if isinstance(module, KbitMoE):
            return name in module.quantized_names
        return False

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        # Float placeholders of an on-the-fly load will hold k bits per element; companions count themselves.
        if param.is_floating_point() and self.param_needs_quantization(model, param_name):
            return _module_of(model, param_name)[0].k / 8
        return param.element_size()

    # ---- module swap ---------------------------------------------------------------------------------------
    def _skip_list(self, model) -> list[str]:
        skip = set(get_keys_to_not_convert(model))
        cfg = self.quantization_config
        head = model.get_output_embeddings()
        head_names = {n for n, m in model.named_modules() if head is not None and m is head}
        head_in_module_k = any(matches_module(n, p) for n in head_names for p in (cfg.module_k or {}))
        if cfg.quantize_lm_head or head_in_module_k:  # a module_k entry for the head asks for it to be quantized
            skip -= self._lm_head_names(model)
        skip.update(self.quantization_config.modules_to_not_convert or [])
        skip.update(getattr(model, "_keep_in_fp32_modules", None) or [])
        return sorted(skip)

    @staticmethod
    def _lm_head_names(model) -> set[str]:
        """Module names of the output head, checked for `quantize_lm_head` (an untied nn.Linear)."""
        head = model.get_output_embeddings()
        names = {n for n, m in model.named_modules() if head is not None and m is head}
        if not names or not isinstance(head, nn.Linear):
            raise ValueError(f"quantize_lm_head=True (or a module_k entry for the head), but {type(model).__name__} "
                             "has no nn.Linear output head to "
                             "quantize")
        tied = {key.removesuffix(".weight") for pair in model.all_tied_weights_keys.items() for key in pair}
        if names & tied:
            raise ValueError(f"quantize_lm_head=True (or a module_k entry for the head), but this model ties its "
                             f"output head {sorted(names)} to the input embeddings (tie_word_embeddings=True), which "
                             "must stay a float table; load it with quantize_lm_head=False and no module_k for it")
        return names

    def _should_convert(self, name: str) -> bool:
        if name.rpartition(".")[2] in ROUTER_NAMES:
            return False
        return not any(matches_module(name, pattern) for pattern in self.modules_to_not_convert)

    def _process_model_before_weight_loading(self, model, device_map=None, checkpoint_files=None, **kwargs):
        tp = tensor_parallel.tp_size(model)
        cfg = self.quantization_config
        self.nonfinite_tensors = []
        if self.pre_quantized:
            _check_checkpoint_headers(checkpoint_files, cfg, model)
        elif cfg.dequantize:
            raise ValueError("dequantize=True turns a kbit checkpoint back into a float model when loading it; this "
                             "checkpoint is not kbit-quantized (leave dequantize=False to quantize it)")
        self.modules_to_not_convert = self._skip_list(model)
        codebooks: dict[int, torch.Tensor] = {}
        replaced = 0
        for name, module in list(model.named_modules()):
            if not name or not self._should_convert(name):
                continue
            k = cfg.k_for(name)
            if k not in codebooks:
                codebooks[k] = cfg.codebook_tensor(k)
            if isinstance(module, nn.Linear) and not isinstance(module, KbitLinear):
                new = KbitLinear(module.in_features, module.out_features, module.bias is not None, k,
                                 cfg.absmax_format, codebooks[k], pre_quantized=self.pre_quantized,
                                 dtype=module.weight.dtype, device=module.weight.device)
            elif is_fused_experts(module) and not isinstance(module, KbitMoE):
                new = KbitMoE(module, k, cfg.absmax_format, codebooks[k], pre_quantized=self.pre_quantized)
            else:
                continue
            model.set_submodule(name, new)
            replaced += 1
        if replaced == 0:
            logger.warning("kbit: no nn.Linear or fused experts module was found to quantize")
        if tp > 1:
            tensor_parallel.prepare_plan(model, tp)

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.nonfinite_tensors:
            shown = self.nonfinite_tensors[:8]
            more = len(self.nonfinite_tensors) - len(shown)
            raise ValueError(
                "kbit cannot quantize non-finite weights; the float checkpoint has NaN/Inf values in "
                f"{len(self.nonfinite_tensors)} tensor(s): " + "; ".join(shown) + (f"; and {more} more" if more else "")
            )
        tensor_parallel.localize(model)
        self._check_loaded(model)
        _drop_kbit_weight_conversions(model)
        if self.pre_quantized and self.quantization_config.dequantize:
            return self._dequantize(model)
        # the backends' in-memory layout, not for offloaded layers: accelerate keeps their tensors elsewhere and swaps
        # them in per forward (a device_map over several GPUs hooks every layer without offloading it)
        offloaded = [name for name, module in model.named_modules() if _offloads(module)]
        # q / k / v and gate / up as one layer each, first: a fused weight takes the layout of its own shape
        fuse_siblings(model, skip=offloaded)
        for _, module in modules_outside(model, offloaded):
            if isinstance(module, KbitLinear) and module._siblings is None:
                module.use_device_layout_()
        # the routers of quantized MoE blocks: one selection kernel where it computes what theirs does
        for name, module in model.named_modules():
            if any(isinstance(child, KbitMoE) for child in module.children()) and name not in offloaded:
                for child in module.children():
                    if not isinstance(child, KbitMoE):
                        fuse_router(child)
        cfg = self.quantization_config
        model.add_model_tags(["kbit", f"kbit-{cfg.k}bit"] + (["kbit-mixed"] if cfg.module_k else []))
        from .hub import install_model_card_hooks

        install_model_card_hooks(model)
        return model

    def _check_loaded(self, model) -> None:
        """Every kbit tensor must be packed and of the exact shape/dtype the format requires (5.17 does not check),
        hold values the format allows (_check_values), and every float parameter of a kbit module must have been
        loaded (transformers leaves them alone: the modules are marked initialized)."""
        absmax_dtype = fmt.ABSMAX_DTYPES[self.quantization_config.absmax_format]
        for mod_name, module in model.named_modules():
            k = getattr(module, "k", None)
            if isinstance(module, KbitLinear):
                items = [("weight", (module.local_out_features, module.local_in_features))]
            elif isinstance(module, KbitMoE):
                items = []
                for name in module.quantized_names:
                    e, out_dim = local_view(getattr(module, name + "_absmax")).shape[:2]
                    items.append((name, (e, out_dim, module.in_features[name])))
            else:
                continue
            for name, shape_oi in items:
                expected = fmt.packed_shapes(shape_oi, k)
                params = {s: getattr(module, name + s) for s in ("",) + COMPANIONS}
                got = {s: local_view(p) for s, p in params.items()}  # a TP shard: its local part
                want = {"": (expected["packed"], torch.uint32), "_absmax": (expected["absmax"], absmax_dtype),
                        "_scale": (expected["scale"], torch.float32),
                        "_codebook": (expected["codebook"], torch.float32)}
                for suffix, (shape, dtype) in want.items():
                    t = got[suffix]
                    # an offloaded tensor (accelerate keeps it on disk / in CPU RAM) is a meta placeholder here
                    if not t.is_meta and not getattr(params[suffix], "_is_hf_initialized", False):
                        # transformers "initializes" missing params with empty memory: never compute with that
                        raise ValueError(f"kbit checkpoint is missing {mod_name}.{name}{suffix} (truncated or "
                                         "incomplete checkpoint?)")
                    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                        raise ValueError(
                            f"kbit checkpoint mismatch at {mod_name}.{name}{suffix}: got {t.dtype} {tuple(t.shape)}, "
                            f"expected {dtype} {tuple(shape)} for k={k}, "
                            f"absmax_format={self.quantization_config.absmax_format!r}"
                        )
                    params[suffix].requires_grad_(False)
                _check_values(f"{mod_name}.{name}", got, self.quantization_config.absmax_format)
            kbit = {f"{n}{s}" for n, _ in items for s in ("",) + COMPANIONS}
            for pname, p in module.named_parameters(recurse=False):
                if pname not in kbit and not p.is_meta and not getattr(p, "_is_hf_initialized", False):
                    raise ValueError(f"the checkpoint is missing {mod_name}.{pname} (truncated or incomplete "
                                     "checkpoint?)")

    # ---- serialization, compile, training ------------------------------------------------------------------
    def get_quantize_ops(self):
        return KbitQuantize(self)

    def is_serializable(self, safe_serialization=None):
        return True

    def get_state_dict_and_metadata(self, model):
        # every process of a tensor-parallel save gets here before any collective: refuse on all of them alike
        for module in model.modules():
            if isinstance(module, (KbitLinear, KbitMoE)):
                refuse_shard(module, "save_pretrained")
        return super().get_state_dict_and_metadata(model)

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (LoRA) on top of frozen kbit weights

    @property
    def is_compileable(self) -> bool:
        return True

    def update_weight_conversions(self, weight_conversions, *args, **kwargs):
        return list(weight_conversions)

    def _dequantize(self, model, dtype=None):
        dtype = dtype or getattr(model.config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, KbitLinear):
                model.set_submodule(name, module.to_linear(dtype))
            elif isinstance(module, KbitMoE):
                model.set_submodule(name, module.to_experts(dtype))
            else:
                unfuse_router(module)
        from .hub import remove_model_card_hooks

        remove_model_card_hooks(model)
        return model


# how safetensors headers name the dtypes of the kbit tensors
_SAFETENSORS_DTYPE = {torch.uint32: "U32", torch.uint8: "U8", torch.float16: "F16", torch.float32: "F32"}
# the absmax_format a stored block-scale dtype means
_ABSMAX_FORMAT_OF = {_SAFETENSORS_DTYPE[dtype]: name for name, dtype in fmt.ABSMAX_DTYPES.items()}


def _check_checkpoint_headers(checkpoint_files, cfg: KbitConfig, model) -> None:
    """The stored dtypes and shapes of the kbit tensors against config.json, from the safetensors headers (no data
    read), before anything loads. transformers casts each checkpoint tensor to its parameter's dtype while loading, so
    a packed weight stored as float32, or e4m4 scales stored as fp16, would otherwise load as silently wrong values; a
    config.json whose k disagrees with the tensors would end in transformers' generic size-mismatch report. A kbit
    tensor P is one with a P_absmax."""
    from safetensors import safe_open

    stored: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (dtype, shape, file)
    for path in checkpoint_files or ():
        if str(path).endswith(".safetensors"):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    header = f.get_slice(key)
                    stored[key] = (header.get_dtype(), tuple(header.get_shape()), str(path))
    for key in sorted(stored):
        if key + "_absmax" in stored:
            _check_stored_kbit_tensor(key, stored, cfg, model)


def _check_stored_kbit_tensor(key: str, stored: dict, cfg: KbitConfig, model) -> None:
    says = "kbit checkpoint mismatch: config.json says"
    absmax_dtype, absmax_shape, path = stored[key + "_absmax"]
    want = _SAFETENSORS_DTYPE[fmt.ABSMAX_DTYPES[cfg.absmax_format]]
    if absmax_dtype != want:
        implied = _ABSMAX_FORMAT_OF.get(absmax_dtype)
        which = (f"which is absmax_format={implied!r}" if implied else
                 "which is no absmax_format (U8 is 'e4m4', F16 is 'fp16')")
        raise ValueError(f"{says} absmax_format={cfg.absmax_format!r}, but {key}_absmax is stored as {absmax_dtype}, "
                         f"{which} ({path})")
    for name, want in ((key, "U32"), (key + "_scale", "F32"), (key + "_codebook", "F32")):
        if name in stored and stored[name][0] != want:
            raise ValueError(f"kbit checkpoint {stored[name][2]}: {name} is stored as {stored[name][0]}, the format "
                             f"needs {want}")
    packed_shape = stored[key][1]
    if len(packed_shape) != len(absmax_shape) or packed_shape[:-1] != absmax_shape[:-1] or not absmax_shape[-1:]:
        raise ValueError(f"kbit checkpoint {path}: {key} has shape {list(packed_shape)} and {key}_absmax "
                         f"{list(absmax_shape)}; the format needs [..., out, blocks * k] and [..., out, blocks]")
    blocks, words = absmax_shape[-1], packed_shape[-1]
    k = cfg.k_for(key.rpartition(".")[0])  # the module a packed tensor belongs to (module_k)
    if blocks and words != blocks * k:
        implied = words // blocks if words % blocks == 0 and words // blocks in fmt.SUPPORTED_K else None
        inputs = _in_features(model, key)
        per_row = f"of {inputs} inputs" if inputs is not None else f"of {blocks} blocks"
        which = (f"which is k={implied} ({blocks} blocks x {implied} words)" if implied else
                 f"which is no k in {fmt.SUPPORTED_K} ({blocks} blocks, {words / blocks:g} words each)")
        raise ValueError(f"{says} k={k}, but {key} has {words} words per row {per_row}, {which} ({path})")
    if key + "_codebook" in stored:
        codebook_shape = stored[key + "_codebook"][1]
        if codebook_shape != (2**k,):
            n = codebook_shape[0] if len(codebook_shape) == 1 else None
            implied = next((k for k in fmt.SUPPORTED_K if 2**k == n), None)
            which = f"the length of a k={implied} codebook" if implied else f"no k in {fmt.SUPPORTED_K}"
            raise ValueError(f"{says} k={k} (a codebook of {2**k} values), but {key}_codebook has shape "
                             f"{list(codebook_shape)}, {which} ({path})")


def _in_features(model, key: str) -> int | None:
    """The input width of the model's float weight that checkpoint key `key` loads into, where the names agree (a
    checkpoint renamed on load, such as Mixtral's block_sparse_moe, gives None)."""
    module_name, _, leaf = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, nn.Linear) and leaf == "weight":
        return module.in_features
    param = getattr(module, leaf, None)
    if isinstance(param, torch.Tensor) and param.dim() == 3:
        return param.shape[-2] if getattr(module, "is_transposed", False) else param.shape[-1]
    return None


def _nonfinite_problem(name: str, value: torch.Tensor, experts: bool) -> str | None:
    """None for a finite tensor, else what is wrong with it (the counts, and which experts of a fused tensor)."""
    if value.numel() == 0 or not value.is_floating_point():
        return None
    lo, hi = torch.aminmax(value)  # one reduction: NaN reaches both ends, +-Inf one of them
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return None
    nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
    text = f"{name} has {nan} NaN and {inf} Inf value(s) among {value.numel()}"
    if experts and value.dim() == 3:
        bad = (~torch.isfinite(value)).flatten(1).any(1).nonzero().flatten().tolist()
        text += f" (in expert(s) {bad})"
    return text


def _empty_outputs(module: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """Packed-shape stand-ins for the quantized tensors of `value`, for a load that is going to fail: they keep the
    loader's bookkeeping whole (no missing or mismatched keys to report) without quantizing anything."""
    shape = tuple(value.shape)
    if isinstance(module, KbitMoE) and module.is_transposed:
        shape = (*shape[:-2], shape[-1], shape[-2])
    packed, absmax, scale = fmt.empty_quantized(shape, module.k, module.absmax_format, value.device)
    codebook = torch.empty(2**module.k, dtype=torch.float32, device=value.device)
    return {name: packed, name + "_absmax": absmax, name + "_scale": scale, name + "_codebook": codebook}


def _check_values(name: str, tensors: dict[str, torch.Tensor], absmax_format: str) -> None:
    """Values a kbit checkpoint can hold (docs/format.md): per-matrix scales are positive powers of two, the codebook
    is 2^K finite, strictly increasing values in [-1, 1], fp16 block scales are finite and >= 0 (every e4m4 byte is
    a valid scale)."""
    if any(t.is_meta for t in tensors.values()):
        return
    scale, codebook = tensors["_scale"], tensors["_codebook"]
    if not (torch.isfinite(scale).all() and (scale > 0).all() and (torch.frexp(scale).mantissa == 0.5).all()):
        raise ValueError(f"kbit checkpoint: {name}_scale must hold positive finite powers of two, got "
                         f"{scale.flatten()[:8].tolist()}")
    fmt.check_codebook_values(codebook, f"kbit checkpoint: {name}_codebook")
    absmax = tensors["_absmax"]
    if absmax_format == "fp16" and not (torch.isfinite(absmax).all() and (absmax >= 0).all()):
        raise ValueError(f"kbit checkpoint: {name}_absmax (fp16 block scales) must be finite and >= 0")


def _offloads(module) -> bool:
    """An accelerate hook on `module` offloads its weights (they live in a weights map, not on the module)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or [hook]
    return any(getattr(h, "offload", False) for h in hooks if h is not None)


def _drop_kbit_weight_conversions(model) -> None:
    """Forget the load-time converters (e.g. MoE per-expert merges) that produced a kbit param, so save_pretrained
    writes the fused packed tensors as they are instead of 'reverting' the merge onto packed data (which splits the
    weight but not its companions, and crashes on 5.17)."""
    conversions = getattr(model, "_weight_conversions", None)
    if not conversions:
        return
    from transformers.core_model_loading import WeightConverter

    kbit_params = [
        f"{mod_name}.{name}"
        for mod_name, module in model.named_modules()
        for name in (("weight",) if isinstance(module, KbitLinear) else getattr(module, "quantized_names", ()))
        if isinstance(module, (KbitLinear, KbitMoE))
    ]

    def targets_kbit(pattern: str) -> bool:
        try:
            return any(re.search(pattern, name) for name in kbit_params)
        except re.error:
            return any(pattern in name for name in kbit_params)

    model._weight_conversions = [
        conv
        for conv in conversions
        if not (
            isinstance(conv, WeightConverter)
            and any(targets_kbit(str(t)) for t in getattr(conv, "_original_target_patterns", conv.target_patterns))
        )
    ]
