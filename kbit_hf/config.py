"""KbitConfig: the `quantization_config` users pass to `from_pretrained` and that lands in config.json."""

from __future__ import annotations

import re
import warnings
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from . import format as fmt


def matches_module(name: str, pattern: str) -> bool:
    """A pattern matches when it equals the dotted path or a run of whole dotted components of it."""
    return re.search(rf"(^|\.){re.escape(pattern)}(\.|$)", name) is not None

# Bumped whenever the meaning of stored tensors changes; a loader refuses a format it does not know.
FORMAT_VERSION = 1


class KbitConfig(QuantizationConfigMixin):
    """K-bit blockwise codebook quantization of every linear layer and MoE expert.

    Args:
        k: bits per weight index, 3, 4 or 5 (2 is accepted for experiments and warns: it breaks models today).
        codebook: "nf0" (the default: normal-float with an exact zero, bitsandbytes' NF4 construction for any k),
            "nf" (symmetric normal-float without a zero level; measured worse at every k >= 3, see docs/quality.md)
            or an explicit list of 2**k strictly increasing finite floats in [-1, 1].
        absmax_format: how each 32-weight block stores its scale: "e4m4" (1 byte, default) or "fp16" (2 bytes).
        modules_to_not_convert: extra module names to keep in full precision, as written in the model
            ("lm_head", "q_proj", "model.layers.0.mlp", ...). A name matches a module when it equals the module's
            dotted path, or a run of its dotted components. Tied embeddings and MoE routers are always kept in full
            precision, and so is the output head unless `quantize_lm_head`.
        quantize_lm_head: also quantize the output head (`lm_head`), which every decode step reads in full: about
            a quarter of the bytes of a K=4 Llama-3-8B. Off by default, like bitsandbytes, HQQ and torchao. A model
            whose head is tied to its input embeddings refuses it (the embeddings must stay a float table).
        dequantize: when loading a kbit checkpoint, dequantize it back to ordinary `nn.Linear`/experts weights.
        module_k: per-module k, e.g. {"down_proj": 5, "self_attn": 5, "lm_head": 5} under k=3: module names or runs
            of dotted components (as in `modules_to_not_convert`) mapped to k; the most specific match wins.
    """

    def __init__(
        self,
        k: int = 4,
        codebook: str | list[float] = "nf0",
        absmax_format: str = "e4m4",
        modules_to_not_convert: list[str] | None = None,
        quantize_lm_head: bool = False,
        dequantize: bool = False,
        module_k: dict[str, int] | None = None,
        format_version: int = FORMAT_VERSION,
        **kwargs: Any,
    ):
        kwargs.pop("quant_method", None)
        if kwargs:
            raise ValueError(
                f"KbitConfig got unknown field(s) {sorted(kwargs)}; this config may come from a newer kbit_hf"
            )
        self.quant_method = "kbit"
        self.k = k
        self.codebook = codebook
        self.absmax_format = absmax_format
        self.modules_to_not_convert = modules_to_not_convert
        self.quantize_lm_head = quantize_lm_head
        self.dequantize = dequantize
        self.module_k = module_k
        self.format_version = format_version
        self.post_init()

    def post_init(self) -> None:
        """Validate every field; raise ValueError naming the field."""
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k not in fmt.SUPPORTED_K:
            raise ValueError(f"k: must be one of {fmt.SUPPORTED_K}, got {self.k!r}")
        if self.module_k is not None:
            if not isinstance(self.module_k, dict):
                raise ValueError(f"module_k: must map module names to k, e.g. {{'down_proj': 5}}, got "
                                 f"{self.module_k!r}")
            for name, value in self.module_k.items():
                if not isinstance(name, str) or not name:
                    raise ValueError(f"module_k: keys must be non-empty module names, got {name!r}")
                if isinstance(value, bool) or not isinstance(value, int) or value not in fmt.SUPPORTED_K:
                    raise ValueError(f"module_k[{name!r}]: must be one of {fmt.SUPPORTED_K}, got {value!r}")
            if isinstance(self.codebook, (list, tuple)) and any(v != self.k for v in self.module_k.values()):
                raise ValueError(f"module_k: a custom codebook list holds {len(self.codebook)} values for k={self.k}; "
                                 "modules at another k need a named codebook ('nf0' or 'nf')")
            self.module_k = dict(self.module_k)
        if self.k == 2 or 2 in (self.module_k or {}).values():
            warnings.warn("k=2: round-to-nearest at 2.25 bits per weight breaks the models measured so far "
                          "(SmolLM2-135M perplexity 5e9, docs/quality.md); it is offered for experiments, use k >= 3 "
                          "for a usable model", UserWarning, stacklevel=3)
        if isinstance(self.codebook, str):
            if self.codebook not in fmt.NAMED_CODEBOOKS:
                raise ValueError(f"codebook: unknown codebook name {self.codebook!r} (expected one of "
                                 f"{sorted(fmt.NAMED_CODEBOOKS)} or a list)")
        elif isinstance(self.codebook, (list, tuple)):
            values = list(self.codebook)
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ValueError("codebook: every value must be a number")
            fmt.check_codebook_values(fmt.make_codebook(self.k, values))  # also its length
            self.codebook = [float(v) for v in values]
        else:
            raise ValueError(f"codebook: expected 'nf' or a list of {2**self.k} floats, got {type(self.codebook)}")
        if self.absmax_format not in fmt.ABSMAX_FORMATS:
            raise ValueError(f"absmax_format: must be one of {fmt.ABSMAX_FORMATS}, got {self.absmax_format!r}")
        if isinstance(self.modules_to_not_convert, str):  # list("q_proj") would be its characters
            raise ValueError(f"modules_to_not_convert: must be a list of module names, got the string "
                             f"{self.modules_to_not_convert!r} (did you mean [{self.modules_to_not_convert!r}]?)")
        if self.modules_to_not_convert is not None:
            self.modules_to_not_convert = list(self.modules_to_not_convert)
            if not all(isinstance(m, str) and m for m in self.modules_to_not_convert):
                raise ValueError("modules_to_not_convert: must be a list of non-empty module names")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head: must be True or False, got {self.quantize_lm_head!r}")
        if not isinstance(self.dequantize, bool):
            raise ValueError(f"dequantize: must be True or False, got {self.dequantize!r}")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"format_version: this kbit_hf reads format {FORMAT_VERSION}, the config says {self.format_version!r}"
            )

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight of the modules at the base `k` (module_k changes it per module)."""
        return fmt.bits_per_weight(self.k, self.absmax_format)

    def k_for(self, module_name: str) -> int:
        """The k of a module: the most specific `module_k` pattern that matches its dotted name (the one with the
        most components; a pattern matches as in `modules_to_not_convert`), else `k`."""
        best, best_len = self.k, -1
        for pattern, k in (self.module_k or {}).items():
            if matches_module(module_name, pattern) and pattern.count(".") > best_len:
                best, best_len = k, pattern.count(".")
        return best

    def codebook_tensor(self, k: int | None = None):
        return fmt.make_codebook(self.k if k is None else k, self.codebook)

    def get_loading_attributes(self) -> dict[str, Any]:
        # What a user's config may change when loading an already-quantized checkpoint.
        return {"dequantize": self.dequantize}

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": "kbit",
            "k": self.k,
            "codebook": self.codebook if isinstance(self.codebook, str) else list(self.codebook),
            "absmax_format": self.absmax_format,
            "modules_to_not_convert": (None if self.modules_to_not_convert is None
                                       else list(self.modules_to_not_convert)),
            "quantize_lm_head": self.quantize_lm_head,
            "dequantize": self.dequantize,
            "module_k": None if self.module_k is None else dict(self.module_k),
            "format_version": self.format_version,
        }

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the given fields (transformers' contract: returns the ones this config does not have) and validate
        them; an invalid value raises ValueError and leaves the config as it was."""
        before = dict(self.__dict__)
        unused = super().update(**kwargs)
        try:
            self.post_init()
        except ValueError:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
        return unused

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KbitConfig) and self.to_dict() == other.to_dict()
