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
from .config import KbitConfig
from .modules import COMPANIONS, KbitLinear, KbitMoE, is_fused_experts

logger = logging.get_logger(__name__)

# Leaf names of MoE routers / gates that are nn.Linear in some families; they stay in full precision.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def matches_module(name: str, pattern: str) -> bool:
    """A pattern matches when it equals the dotted path or a run of whole dotted components of it."""
    return re.search(rf"(^|\.){re.escape(pattern)}(\.|$)", name) is not None


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
        return {prefix + key: tensor for key, tensor in module.quantize_param(name, value).items()}


class KbitHfQuantizer(HfQuantizer):
    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

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
            return self.quantization_config.k / 8
        return param.element_size()

    # ---- module swap ---------------------------------------------------------------------------------------
    def _skip_list(self, model) -> list[str]:
        skip = set(get_keys_to_not_convert(model))
        if self.quantization_config.quantize_lm_head:
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
            raise ValueError(f"quantize_lm_head=True, but {type(model).__name__} has no nn.Linear output head to "
                             "quantize")
        tied = {key.removesuffix(".weight") for pair in model.all_tied_weights_keys.items() for key in pair}
        if names & tied:
            raise ValueError(f"quantize_lm_head=True, but this model ties its output head {sorted(names)} to the input "
                             "embeddings (tie_word_embeddings=True), which must stay a float table; load it with "
                             "quantize_lm_head=False")
        return names

    def _should_convert(self, name: str) -> bool:
        if name.rpartition(".")[2] in ROUTER_NAMES:
            return False
        return not any(matches_module(name, pattern) for pattern in self.modules_to_not_convert)

    def _process_model_before_weight_loading(self, model, device_map=None, checkpoint_files=None, **kwargs):
        if getattr(model.config, "distributed_config", None) is not None or getattr(model, "_tp_size", None):
            raise NotImplementedError("kbit does not support tensor or expert parallelism yet; load without tp_plan")
        cfg = self.quantization_config
        if self.pre_quantized:
            _check_checkpoint_dtypes(checkpoint_files, cfg.absmax_format)
        elif cfg.dequantize:
            raise ValueError("dequantize=True turns a kbit checkpoint back into a float model when loading it; this "
                             "checkpoint is not kbit-quantized (leave dequantize=False to quantize it)")
        self.modules_to_not_convert = self._skip_list(model)
        codebook = cfg.codebook_tensor()
        replaced = 0
        for name, module in list(model.named_modules()):
            if not name or not self._should_convert(name):
                continue
            if isinstance(module, nn.Linear) and not isinstance(module, KbitLinear):
                new = KbitLinear(module.in_features, module.out_features, module.bias is not None, cfg.k,
                                 cfg.absmax_format, codebook, pre_quantized=self.pre_quantized,
                                 dtype=module.weight.dtype, device=module.weight.device)
            elif is_fused_experts(module) and not isinstance(module, KbitMoE):
                new = KbitMoE(module, cfg.k, cfg.absmax_format, codebook, pre_quantized=self.pre_quantized)
            else:
                continue
            model.set_submodule(name, new)
            replaced += 1
        if replaced == 0:
            logger.warning("kbit: no nn.Linear or fused experts module was found to quantize")

    def _process_model_after_weight_loading(self, model, **kwargs):
        self._check_loaded(model)
        _drop_kbit_weight_conversions(model)
        if self.pre_quantized and self.quantization_config.dequantize:
            return self._dequantize(model)
        for module in model.modules():
            # the backends' in-memory layout (not for offloaded layers: accelerate keeps their tensors elsewhere and
            # swaps them in per forward)
            if isinstance(module, KbitLinear) and not hasattr(module, "_hf_hook"):
                module.use_device_layout_()
        model.add_model_tags(["kbit", f"kbit-{self.quantization_config.k}bit"])
        from .hub import install_model_card_hooks

        install_model_card_hooks(model)
        return model

    def _check_loaded(self, model) -> None:
        """Every kbit tensor must be packed and of the exact shape/dtype the format requires (5.17 does not check),
        hold values the format allows (_check_values), and every float parameter of a kbit module must have been
        loaded (transformers leaves them alone: the modules are marked initialized)."""
        k = self.quantization_config.k
        absmax_dtype = fmt.ABSMAX_DTYPES[self.quantization_config.absmax_format]
        for mod_name, module in model.named_modules():
            if isinstance(module, KbitLinear):
                items = [("weight", (module.out_features, module.in_features))]
            elif isinstance(module, KbitMoE):
                items = []
                for name in module.quantized_names:
                    e, out_dim = getattr(module, name + "_absmax").shape[:2]
                    items.append((name, (e, out_dim, module.in_features[name])))
            else:
                continue
            for name, shape_oi in items:
                expected = fmt.packed_shapes(shape_oi, k)
                got = {s: getattr(module, name + s) for s in ("",) + COMPANIONS}
                want = {"": (expected["packed"], torch.uint32), "_absmax": (expected["absmax"], absmax_dtype),
                        "_scale": (expected["scale"], torch.float32), "_codebook": (expected["codebook"], torch.float32)}
                for suffix, (shape, dtype) in want.items():
                    t = got[suffix]
                    # an offloaded tensor (accelerate keeps it on disk / in CPU RAM) is a meta placeholder here
                    if not t.is_meta and not getattr(t, "_is_hf_initialized", False):
                        # transformers "initializes" missing params with empty memory: never compute with that
                        raise ValueError(f"kbit checkpoint is missing {mod_name}.{name}{suffix} (truncated or "
                                         "incomplete checkpoint?)")
                    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                        raise ValueError(
                            f"kbit checkpoint mismatch at {mod_name}.{name}{suffix}: got {t.dtype} {tuple(t.shape)}, "
                            f"expected {dtype} {tuple(shape)} for k={k}, "
                            f"absmax_format={self.quantization_config.absmax_format!r}"
                        )
                    t.requires_grad_(False)
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
        from .hub import remove_model_card_hooks

        remove_model_card_hooks(model)
        return model


# how safetensors headers name the dtypes of the kbit tensors
_SAFETENSORS_DTYPE = {torch.uint32: "U32", torch.uint8: "U8", torch.float16: "F16", torch.float32: "F32"}


def _check_checkpoint_dtypes(checkpoint_files, absmax_format: str) -> None:
    """The stored dtypes of the kbit tensors, from the safetensors headers (no data read). transformers casts each
    checkpoint tensor to its parameter's dtype while loading, so a packed weight stored as float32, or e4m4 scales
    stored as fp16, would otherwise load as silently wrong values. A kbit tensor P is one with a P_absmax."""
    from safetensors import safe_open

    stored: dict[str, tuple[str, str]] = {}
    for path in checkpoint_files or ():
        if str(path).endswith(".safetensors"):
            with safe_open(str(path), framework="pt") as f:
                stored.update({key: (f.get_slice(key).get_dtype(), str(path)) for key in f.keys()})
    absmax_dtype = _SAFETENSORS_DTYPE[fmt.ABSMAX_DTYPES[absmax_format]]
    for key in stored:
        if key + "_absmax" not in stored:
            continue
        for name, want in ((key, _SAFETENSORS_DTYPE[torch.uint32]), (key + "_absmax", absmax_dtype),
                           (key + "_scale", _SAFETENSORS_DTYPE[torch.float32]),
                           (key + "_codebook", _SAFETENSORS_DTYPE[torch.float32])):
            if name in stored and stored[name][0] != want:
                raise ValueError(f"kbit checkpoint {stored[name][1]}: {name} is stored as {stored[name][0]}, the "
                                 f"format needs {want} (absmax_format={absmax_format!r})")


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
