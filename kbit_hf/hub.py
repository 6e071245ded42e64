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
# Nothing in a checkpoint makes transformers import the package of its quantization method (no entry points; auto_map
# code runs only with trust_remote_code=True), so the card says what a load without kbit_hf does.
LOAD_NOTE = ("Loading needs `pip install kbit_hf` and `import kbit_hf` before `from_pretrained`: transformers does not "
             "import it by itself. Without it, transformers logs \"Unknown quantization type, got kbit\", skips the "
             "quantization and stops with a size-mismatch report; with `ignore_mismatched_sizes=True` it would return "
             "a model with random weights instead.")


def card_section(config) -> str:
    names = {"nf": "normal-float (nf)", "nf0": "normal-float with zero (nf0)"}
    codebook = names.get(config.codebook, f"custom ({len(config.codebook)} values)") if isinstance(
        config.codebook, str) else f"custom ({len(config.codebook)} values)"
    head = "; the output head is quantized too" if config.quantize_lm_head else ""
    kept = ("Tied embeddings and MoE routers" if config.quantize_lm_head
            else "The output head, tied embeddings and MoE routers")
    extra = ", as do: " + ", ".join(config.modules_to_not_convert) if config.modules_to_not_convert else ""
    mixed = getattr(config, "module_k", None)
    if mixed:
        head += "; per-module k: " + ", ".join(f"{name} k={k}" for name, k in mixed.items())
    return (
        f"{_SECTION_TITLE}\n\n"
        f"This model's linear layers and MoE experts are quantized with "
        f"[kbit_hf](https://pypi.org/project/kbit_hf/): k={config.k} bits per weight index, {codebook} codebook, "
        f"blocks of {fmt.BLOCK} weights with one {config.absmax_format} scale each "
        f"({config.bits_per_weight:g} bits per weight){head}. {kept} stay in full precision{extra}.\n\n"
        "```python\nimport kbit_hf  # registers the 'kbit' quantization method\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(\"<this repo>\", device_map=\"auto\")\n```\n\n"
        f"{LOAD_NOTE}\n"
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


def _push_to_hub(self, *args, **kwargs):
    token = _ACTIVE_CONFIG.set(self.config.quantization_config)
    try:
        return type(self).push_to_hub(self, *args, **kwargs)
    finally:
        _ACTIVE_CONFIG.reset(token)


def _save_pretrained(self, save_directory, *args, **kwargs):
    token = _ACTIVE_CONFIG.set(self.config.quantization_config)
    try:
        result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    finally:
        _ACTIVE_CONFIG.reset(token)
    readme = os.path.join(save_directory, "README.md")
    if not os.path.exists(readme):
        _local_card(self.config.quantization_config).save(readme)
    return result


def install_model_card_hooks(model) -> None:
    """Bind the card-aware push_to_hub/save_pretrained to this model instance (partials of module functions, so
    copy.deepcopy and pickle rebind them to the copy; a bound method of a function the class lacks does not
    unpickle)."""
    _patch_card_factory()
    for name, fn in (("push_to_hub", _push_to_hub), ("save_pretrained", _save_pretrained)):
        setattr(model, name, functools.partial(fn, model))


def remove_model_card_hooks(model) -> None:
    for name in ("push_to_hub", "save_pretrained"):
        model.__dict__.pop(name, None)
