"""LoRA on kbit models with PEFT: `KbitLoraLinear`, the LoRA layer PEFT builds around a `KbitLinear`.

PEFT's default LoRA Linear merges an adapter by adding its delta to `base_layer.weight`, which a KbitLinear holds as
packed indices. KbitLoraLinear merges the way PEFT's bitsandbytes 4-bit layer does: dequantize, add the delta (unmerge:
subtract it), quantize the sum again into the layer's own format (same k, stored codebook, absmax_format). Training and
the unmerged forward are PEFT's own (the base layer's forward plus the adapter's).

`import kbit_hf` arranges (kbit_hf/_register.py) for `install()` to run as soon as peft is imported, so
`get_peft_model(kbit_model, LoraConfig(...))`, `PeftModel.from_pretrained(kbit_model, ...)` and `merge_and_unload()`
need no extra step. This module imports peft: nothing imports it unless peft is installed and imported.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from .modules import KbitLinear, KbitMoE, refuse_shard

# init_lora_weights values whose initialisation reads or rewrites the base layer's dense weight
_BASE_WEIGHT_INITS = ("pissa", "corda", "olora", "mica", "loftq", "orthogonal", "lora_ga")

# peft >= 0.19 builds LoRA layers from the LoraConfig; older releases pass its fields one by one
_LAYERS_TAKE_CONFIG = "config" in inspect.signature(LoraLinear.__init__).parameters

_ROUNDING_NOTE = ("kbit quantizes the merged weight again into the layer's format, and a dequantized weight sits on a "
                  "code, so a delta under half a codebook step rounds back to it: a typical adapter is mostly lost, "
                  "and an unmerge does not restore the weights exactly. To ship a merged kbit model, merge the adapter "
                  "into the float model and quantize that (docs/qlora.md)")


class KbitLoraLinear(LoraLinear):
    """PEFT's LoRA Linear around a KbitLinear, with merge / unmerge that re-quantize (see the module docstring)."""

    def update_layer(self, adapter_name, r, *args, **kwargs):
        config = kwargs.get("config")
        init = getattr(config, "init_lora_weights", kwargs.get("init_lora_weights", True))
        if isinstance(init, str) and init.lower().startswith(_BASE_WEIGHT_INITS):
            raise ValueError(f"init_lora_weights={init!r} reads the base layer's dense weight, which a kbit layer "
                             "holds as packed indices; use init_lora_weights=True (the default) or 'gaussian', or "
                             "dequantize the model first (model.dequantize())")
        if getattr(config, "use_dora", kwargs.get("use_dora", False)):
            raise ValueError("use_dora=True: DoRA needs the base layer's dense weight in every forward, which a kbit "
                             "layer does not hold; use plain LoRA (use_dora=False), or dequantize the model first "
                             "(model.dequantize())")
        return super().update_layer(adapter_name, r, *args, **kwargs)

    def _apply_deltas(self, weight: torch.Tensor, adapters: list[str], sign: int) -> torch.Tensor:
        variants = getattr(self, "lora_variant", {})
        for adapter in adapters:
            if adapter in variants:
                variant = variants[adapter]
                weight = (variant.merge_safe(self, adapter, weight) if sign > 0
                          else variant.unmerge(self, adapter, weight)).float()
            else:
                weight = weight + sign * self.get_delta_weight(adapter).to(weight.device, torch.float32)
        return weight

    def _biased(self, adapters: list[str]) -> list[str]:
        """The adapters with a bias to merge (lora_bias=True); refused, before anything changes, where the base layer
        has no bias to merge it into."""
        biased = [a for a in adapters if getattr(self, "lora_bias", {}).get(a, False)]
        if biased and self.get_base_layer().bias is None:
            raise RuntimeError(f"adapter {biased[0]!r} has lora_bias=True, but its base layer has no bias to merge it "
                               "into")
        return biased

    def _apply_biases(self, biased: list[str], sign: int) -> None:
        """Add (sign +1) or subtract the biases of the adapters `biased` (from _biased) to the base layer's bias."""
        base = self.get_base_layer()
        for adapter in biased:
            delta = self.lora_B[adapter].bias * self.scaling[adapter]
            base.bias.data += sign * delta.to(base.bias.dtype)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge the adapters into the base layer: weight = quantize(dequantize(weight) + their deltas), one
        re-quantization for all of them. Not exact: see docs/qlora.md. safe_merge is accepted for PEFT's API; the
        merged weight is always checked for NaN/Inf before anything changes."""
        adapters = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A.keys()]
        if not adapters:
            return
        warnings.warn(f"merging LoRA into kbit layers: {_ROUNDING_NOTE}", UserWarning, stacklevel=2)
        base: KbitLinear = self.get_base_layer()
        biased = self._biased(adapters)  # a bias that cannot be merged refuses the merge before the weight changes
        weight = self._apply_deltas(base.dequantized_weight(torch.float32), adapters, +1)
        bad = int((~torch.isfinite(weight)).sum())
        if bad:
            raise ValueError(f"merging adapter(s) {adapters} gives {bad} NaN/Inf weight(s) in a {base.out_features}x"
                             f"{base.in_features} kbit layer: the adapter seems to be broken; nothing was merged")
        base.set_weight_(weight)
        self._apply_biases(biased, +1)
        self.merged_adapters.extend(adapters)

    def unmerge(self) -> None:
        """Subtract the merged adapters again: weight = quantize(dequantize(weight) - their deltas). After a merge this
        does not give back the original packed weight bit for bit (two roundings; docs/qlora.md gives the bound)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        adapters = [a for a in reversed(self.merged_adapters) if a in self.lora_A.keys()]
        if adapters:
            warnings.warn(f"unmerging LoRA from kbit layers: {_ROUNDING_NOTE}", UserWarning, stacklevel=2)
            base: KbitLinear = self.get_base_layer()
            base.set_weight_(self._apply_deltas(base.dequantized_weight(torch.float32), adapters, -1))
            self._apply_biases(self._biased(adapters), -1)
        self.merged_adapters.clear()


def dispatch_kbit(target: torch.nn.Module, adapter_name: str, config, **kwargs) -> torch.nn.Module | None:
    """PEFT dispatcher: KbitLoraLinear for a KbitLinear, None (PEFT's own dispatchers decide) for anything else."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    custom = getattr(config, "_custom_modules", None) or {}
    if any(isinstance(base, cls) for cls in custom):  # a layer the user registered for this type wins
        return None
    parameter_name = kwargs.get("parameter_name")
    if parameter_name is not None and isinstance(base, (KbitLinear, KbitMoE)):
        raise ValueError(f"target_parameters: {parameter_name!r} of {type(base).__name__} is stored as packed kbit "
                         "indices, which LoRA on a parameter cannot adapt; target the module instead "
                         "(target_modules; fused MoE experts have no LoRA path in kbit yet)")
    if isinstance(base, KbitLinear):
        refuse_shard(base, "LoRA")  # the adapter's matrices would be the whole layer's, its output a shard's
        if _LAYERS_TAKE_CONFIG:
            return KbitLoraLinear(target, adapter_name, config=config, **kwargs)
        return KbitLoraLinear(target, adapter_name, **kwargs)  # peft < 0.19: the config's fields come in kwargs
    return None


def install() -> None:
    """Route PEFT's LoRA layer creation for KbitLinear base layers to KbitLoraLinear (idempotent).

    PEFT picks a LoRA layer class in `LoraModel._create_new_module` (a list of dispatchers; the user-facing hook,
    `LoraConfig._register_custom_module`, would need a call on every config). This wraps that static method so that
    `dispatch_kbit` is asked first."""
    current = LoraModel.__dict__.get("_create_new_module")
    if not isinstance(current, staticmethod):
        raise RuntimeError(f"peft's LoraModel._create_new_module is {type(current).__name__}, not the staticmethod "
                           "kbit_hf wraps; register the layer per config instead: "
                           "config._register_custom_module({KbitLinear: KbitLoraLinear})")
    # wrapping peft's own function again (not an earlier wrapper) keeps this right after importlib.reload(kbit_hf...)
    original = getattr(current.__func__, "_kbit_original", current.__func__)

    @functools.wraps(original)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        new_module = dispatch_kbit(target, adapter_name, lora_config, **kwargs)
        return new_module if new_module is not None else original(lora_config, adapter_name, target, **kwargs)

    _create_new_module._kbit_original = original
    LoraModel._create_new_module = staticmethod(_create_new_module)
