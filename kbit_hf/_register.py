"""Registration of quant_method "kbit" with transformers, and of kbit's LoRA layer with PEFT once peft is imported
(idempotent: safe under re-import and reload)."""

from __future__ import annotations

import importlib.abc
import logging
import sys

logger = logging.getLogger(__name__)


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
    register_with_peft()


def register_with_peft() -> None:
    """Install kbit's LoRA layer into PEFT now if peft is imported, else right after `import peft` runs: peft stays an
    optional dependency and `import kbit_hf` does not pay for importing it."""
    if "peft" in sys.modules:
        _install_peft_integration()
        return
    if not any(type(finder).__name__ == _AfterPeftImport.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeftImport())


def _install_peft_integration() -> None:
    try:
        from .peft_integration import install

        install()
    except Exception as e:  # an incompatible peft must not break `import peft`; only merging kbit layers is lost
        logger.warning("kbit_hf could not add its LoRA layer to this peft (%s: %s): LoRA training on kbit models "
                       "works, merge_and_unload() of kbit layers does not; see docs/qlora.md", type(e).__name__, e)


class _AfterPeftImport(importlib.abc.MetaPathFinder):
    """Import hook: finds `peft` with the other finders and wraps its loader, so _install_peft_integration runs once
    the package's __init__ has executed (every peft submodule kbit uses is loaded by then). It stays in place until
    peft is executed: a bare importlib.util.find_spec("peft"), as transformers' availability checks do, imports
    nothing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "peft":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        finally:
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _AfterPeftImport.__name__]
        _install_peft_integration()
