"""Model cards for kbit models: a pushed or saved kbit model says how it was quantized.

transformers builds the pushed card in `create_and_tag_model_card`; kbit wraps it (once, on import) and, while a
kbit model's `push_to_hub`/`save_pretrained` runs, appends a "kbit quantization" section. `save_pretrained` also
writes that card as README.md when the folder has none, so a folder uploaded by other means carries it too.
"""

from __future__ import annotations

import contextvars
import functools
import os

from . import format as fmt

_ACTIVE_CONFIG: contextvars.ContextVar = contextvars.ContextVar("kbit_active_config", default=None)
_SECTION_TITLE = "## kbit quantization"


def card_section(config) -> str:
    names = {"nf": "normal-float (nf)", "nf0": "normal-float with zero (nf0)"}
    codebook = names.get(config.codebook, f"custom ({len(config.codebook)} values)") if isinstance(
        config.codebook, str) else f"custom ({len(config.codebook)} values)"
    return (
        f"{_SECTION_TITLE}\n\n"
        f"This model's linear layers and MoE experts are quantized with "
        f"[kbit_hf](https://pypi.org/project/kbit_hf/): k={config.k} bits per weight index, {codebook} codebook, "
        f"blocks of {fmt.BLOCK} weights with one {config.absmax_format} scale each "
        f"({config.bits_per_weight:g} bits per weight). The output head, tied embeddings and MoE routers stay in "
        f"full precision{', as do: ' + ', '.join(config.modules_to_not_convert) if config.modules_to_not_convert else ''}.\n\n"
        "```python\nimport kbit_hf  # registers the 'kbit' quantization method\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(\"<this repo>\", device_map=\"auto\")\n```\n"
    )


def _with_section(card, config):
    if _SECTION_TITLE not in (card.text or ""):
        card.text = (card.text or "").rstrip() + "\n\n" + card_section(config)
    tags = list(card.data.tags or [])
    for tag in ("kbit", f"kbit-{config.k}bit"):
        if tag not in tags:
            tags.append(tag)
    card.data.tags = tags
    return card


def _patch_card_factory() -> None:
    import transformers.modeling_utils as modeling_utils
    import transformers.utils.hub as hub

    original = hub.create_and_tag_model_card
    if getattr(original, "_kbit_wrapped", False):
        return

    @functools.wraps(original)
    def create_and_tag_model_card(*args, **kwargs):
        card = original(*args, **kwargs)
        config = _ACTIVE_CONFIG.get()
        return _with_section(card, config) if config is not None else card

    create_and_tag_model_card._kbit_wrapped = True
    hub.create_and_tag_model_card = create_and_tag_model_card
    if hasattr(modeling_utils, "create_and_tag_model_card"):
        modeling_utils.create_and_tag_model_card = create_and_tag_model_card


def _local_card(config):
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(library_name="transformers", tags=["kbit", f"kbit-{config.k}bit"])
    return _with_section(ModelCard.from_template(data, model_description="A kbit-quantized transformers model."), config)


def install_model_card_hooks(model) -> None:
    _patch_card_factory()
    cls = type(model)

    def push_to_hub(*args, **kwargs):
        token = _ACTIVE_CONFIG.set(model.config.quantization_config)
        try:
            return cls.push_to_hub(model, *args, **kwargs)
        finally:
            _ACTIVE_CONFIG.reset(token)

    def save_pretrained(save_directory, *args, **kwargs):
        token = _ACTIVE_CONFIG.set(model.config.quantization_config)
        try:
            result = cls.save_pretrained(model, save_directory, *args, **kwargs)
        finally:
            _ACTIVE_CONFIG.reset(token)
        readme = os.path.join(save_directory, "README.md")
        if not os.path.exists(readme):
            _local_card(model.config.quantization_config).save(readme)
        return result

    functools.update_wrapper(push_to_hub, cls.push_to_hub)
    functools.update_wrapper(save_pretrained, cls.save_pretrained)
    model.push_to_hub = push_to_hub
    model.save_pretrained = save_pretrained


def remove_model_card_hooks(model) -> None:
    for name in ("push_to_hub", "save_pretrained"):
        model.__dict__.pop(name, None)
