"""Registration of quant_method "kbit" with transformers (idempotent: safe under re-import and reload)."""

from __future__ import annotations


def register() -> None:
    from transformers.quantizers import auto, register_quantization_config, register_quantizer

    from .config import KbitConfig
    from .quantizer import KbitHfQuantizer

    # register_* raise on a second registration; after importlib.reload the classes are new objects, so replace.
    if "kbit" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING["kbit"] = KbitConfig
    else:
        register_quantization_config("kbit")(KbitConfig)
    if "kbit" in auto.AUTO_QUANTIZER_MAPPING:
        auto.AUTO_QUANTIZER_MAPPING["kbit"] = KbitHfQuantizer
    else:
        register_quantizer("kbit")(KbitHfQuantizer)
    # Let a user's KbitConfig(dequantize=True) apply when loading a checkpoint that already has a kbit config.
    types = tuple(t for t in auto.LOADING_ATTRIBUTES_CONFIG_TYPES if t.__name__ != "KbitConfig")
    auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*types, KbitConfig)
