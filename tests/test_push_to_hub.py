"""`model.push_to_hub(...)` of kbit-quantized tiny models, against a fake Hub HTTP server on 127.0.0.1.

No network: huggingface_hub's endpoint is pointed at tests/fake_hub.py (a threaded http.server), which records the
committed files and answers 400 to anything it does not know (and the fixture asserts it saw no such request).
Checked, for a dense (llama) and an MoE (mixtral) model:
  * the uploaded files: config.json with the kbit quantization_config, safetensors with packed uint32 tensors,
    README.md with the "kbit quantization" section and the kbit tags;
  * the uploaded files, written to a folder, reload with `from_pretrained` into a bit-identical state_dict and
    identical logits, without ever calling the quantize op;
  * the same for a sharded push (several safetensors shards + index);
  * a second push into the same repo starts from the card already on the Hub and keeps a single kbit section.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import huggingface_hub
import huggingface_hub.constants as hf_constants
import transformers
import transformers.utils.hub as tf_hub
from huggingface_hub import ModelCard
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

import kbit_hf
import kbit_hf.modules
import kbit_hf.ops
import kbit_hf.backends.reference
from kbit_hf.modules import EXPERT_PROJS, KbitLinear, KbitMoE
from fake_hub import FakeHub
from tiny_models import VOCAB, tiny_model

TOKEN = "hf_dummy"
FAMILIES = ["llama", "mixtral", "qwen3_moe", "gpt_oss"]  # dense + three MoE families
SHARDED_FAMILIES = ["llama", "mixtral"]


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub on 127.0.0.1 that every huggingface_hub / transformers Hub call of this test goes to."""
    with FakeHub(token=TOKEN) as fake:
        url = fake.endpoint
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.delenv("HUGGINGFACE_CO_STAGING", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        no_proxy = ",".join(x for x in (os.environ.get("NO_PROXY"), "127.0.0.1", "localhost") if x)
        monkeypatch.setenv("NO_PROXY", no_proxy)
        monkeypatch.setenv("no_proxy", no_proxy)
        # huggingface_hub reads these module constants at call time (they were computed from the env at import).
        monkeypatch.setattr(hf_constants, "ENDPOINT", url)
        monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True, raising=False)
        monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
        # HfApi instances capture the endpoint when built: transformers caches one in `hf_api()`, huggingface_hub
        # has a module-level default one.
        monkeypatch.setattr(tf_hub, "_hf_api", None, raising=False)
        monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", url)
        yield fake
        assert fake.errors == [], f"the fake Hub got requests it does not support: {fake.errors}"
        assert getattr(tf_hub, "_hf_api", None) is None or tf_hub._hf_api.endpoint == url


_SOURCES: dict[str, Path] = {}


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    """family -> a folder holding the float tiny model (saved once per module)."""

    def get(family: str) -> Path:
        if family not in _SOURCES:
            path = tmp_path_factory.mktemp(f"src_{family}")
            tiny_model(family).save_pretrained(path)
            _SOURCES[family] = path
        return _SOURCES[family]

    return get


def quantize_on_load(folder: Path):
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=kbit_hf.KbitConfig(k=4))
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def forbid_quantize(mp: pytest.MonkeyPatch) -> list:
    """Make every quantize entry point record the call and raise: a pre-quantized load must not quantize.

    Returns the list of calls (transformers turns exceptions raised inside weight conversions into a generic
    loading error, so the record is what tells that quantize was reached).
    """
    calls: list = []

    def boom(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("kbit quantize was called while loading a pre-quantized checkpoint")

    mp.setattr(kbit_hf.backends.reference, "quantize", boom)  # what the torch.ops.kbit.quantize op runs
    mp.setattr(kbit_hf.ops, "quantize", boom)  # what the modules call
    mp.setattr(kbit_hf.modules, "_quantize", boom)
    return calls


def write_files(files: dict[str, bytes], folder: Path) -> Path:
    for name, content in files.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return folder


def reload_without_quantizing(files: dict[str, bytes], folder: Path):
    write_files(files, folder)
    with pytest.MonkeyPatch.context() as mp:
        calls = forbid_quantize(mp)
        model = AutoModelForCausalLM.from_pretrained(folder)
    assert calls == [], "quantize was called while reloading the pushed (pre-quantized) checkpoint"
    return model.eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_identical(pushed, reloaded) -> None:
    sd_a, sd_b = pushed.state_dict(), reloaded.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for key, a in sd_a.items():
        b = sd_b[key]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), key
        assert torch.equal(_bits(a), _bits(b)), f"{key} differs after the Hub round trip"
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = pushed(ids).logits, reloaded(ids).logits
    assert torch.isfinite(la).all()
    assert torch.equal(_bits(la), _bits(lb)), "logits differ after the Hub round trip"


def kbit_module_names(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, (KbitLinear, KbitMoE))}


def check_packed_weights(model, tensors: dict[str, torch.Tensor], family: str) -> None:
    """The upload holds the model's packed weights: uint32 tensors, each with its absmax/scale/codebook.

    Checkpoint names may differ from the module names (transformers renames on save, e.g. mixtral's
    `mlp.experts` is saved as `block_sparse_moe.experts`), so tensors are matched by shape and content.
    """
    modules = kbit_module_names(model)
    assert any(t is KbitLinear for t in modules.values())
    if family != "llama":
        assert any(t is KbitMoE for t in modules.values()), "the MoE experts were not quantized"
    packed_up = {k: t for k, t in tensors.items() if t.dtype == torch.uint32}
    packed_model = {k: t for k, t in model.state_dict().items() if t.dtype == torch.uint32}
    n_expected = sum(1 if kind is KbitLinear else len(model.get_submodule(n).quantized_names)
                     for n, kind in modules.items())
    assert len(packed_model) == n_expected
    assert len(packed_up) == n_expected, (len(packed_up), n_expected)
    for key in packed_up:
        for suffix in ("_absmax", "_scale", "_codebook"):
            assert f"{key}{suffix}" in tensors, f"{key}{suffix} missing from the uploaded safetensors"
    fingerprint = lambda t: (tuple(t.shape), _bits(t).numpy().tobytes())  # noqa: E731
    assert sorted(map(fingerprint, packed_up.values())) == sorted(map(fingerprint, packed_model.values()))
    if family != "llama":  # fused expert weights are stored packed, with a leading experts dim
        experts = [t for k, t in packed_up.items() if k.split(".")[-1] in EXPERT_PROJS]
        assert experts and all(t.dim() == 3 for t in experts), sorted(packed_up)
    # the output head stays in full precision
    assert tensors["lm_head.weight"].dtype == torch.bfloat16


def uploaded_tensors(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            part = load_safetensors(content)
            assert not (part.keys() & tensors.keys()), f"tensor names repeated across shards: {part.keys() & tensors.keys()}"
            tensors.update(part)
    return tensors


def check_card(readme: bytes) -> ModelCard:
    card = ModelCard(readme.decode())
    assert "kbit quantization" in card.text
    assert card.text.count("## kbit quantization") == 1
    assert "k=4" in card.text
    assert "kbit" in card.data.tags and "kbit-4bit" in card.data.tags
    assert len(card.data.tags) == len(set(card.data.tags))
    assert card.data.library_name == "transformers"
    return card


def check_config(files: dict[str, bytes]) -> None:
    qc = json.loads(files["config.json"])["quantization_config"]
    assert qc["quant_method"] == "kbit"
    assert qc["k"] == 4


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_push_to_hub_single_file(family, hub, source_dir, tmp_path):
    model = quantize_on_load(source_dir(family))
    assert kbit_module_names(model)

    result = model.push_to_hub("user/tiny-kbit4", token=TOKEN)

    repo = hub.repos["user/tiny-kbit4"]
    assert len(repo.commits) == 1
    assert getattr(result, "oid", None) == repo.head  # push_to_hub returns the CommitInfo the fake answered
    files = repo.commits[0].files
    assert {"config.json", "model.safetensors", "README.md"} <= files.keys(), sorted(files)
    assert not any(n.endswith(".bin") for n in files), sorted(files)
    assert "model.safetensors.index.json" not in files

    # the Hub conversation push_to_hub had: create repo, look for an existing card (absent: 404 EntryNotFound),
    # validate the card, preupload (-> regular), commit
    posts = hub.paths_requested("POST")
    assert posts[0] == "/api/repos/create"
    assert "/api/models/user/tiny-kbit4/preupload/main" in posts
    assert posts[-1] == "/api/models/user/tiny-kbit4/commit/main"
    assert ("/user/tiny-kbit4/resolve/main/README.md", 404) in [(p, s) for _, p, s in hub.requests]

    # (1) what was uploaded
    check_config(files)
    check_packed_weights(model, uploaded_tensors(files), family)
    check_card(files["README.md"])

    # (2) the uploaded files reload, pre-quantized, to the very same model
    reloaded = reload_without_quantizing(files, tmp_path / "download")
    assert kbit_module_names(reloaded) == kbit_module_names(model)
    assert_identical(model, reloaded)

    # A second push of the same model into the same repo starts from the card now on the Hub (downloaded: 200).
    # Serialization is deterministic and the kbit section is not appended twice, so every file -- README.md
    # included -- has the oid the Hub already has, and huggingface_hub skips the commit altogether.
    n_before = len(hub.requests)
    model.push_to_hub("user/tiny-kbit4", token=TOKEN, commit_message="push again")
    assert ("/user/tiny-kbit4/resolve/main/README.md", 200) in [(p, s) for _, p, s in hub.requests[n_before:]]
    assert len(repo.commits) == 1, f"re-push changed {sorted(repo.commits[-1].files)}"
    check_card(repo.files["README.md"])


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_push_to_hub_sharded(family, hub, source_dir, tmp_path):
    model = quantize_on_load(source_dir(family))

    model.push_to_hub("user/tiny-kbit4-sharded", token=TOKEN, max_shard_size="20KB")

    repo = hub.repos["user/tiny-kbit4-sharded"]
    assert len(repo.commits) == 1
    files = repo.commits[0].files
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    assert len(shards) >= 3, shards
    assert "model.safetensors" not in files
    index = json.loads(files["model.safetensors.index.json"])
    assert sorted(set(index["weight_map"].values())) == shards

    check_config(files)
    tensors = uploaded_tensors(files)
    assert set(index["weight_map"]) == set(tensors)
    check_packed_weights(model, tensors, family)
    check_card(files["README.md"])

    # (3) the sharded upload reloads to the very same model
    reloaded = reload_without_quantizing(files, tmp_path / "download")
    assert_identical(model, reloaded)


def test_forbid_quantize_guard_is_effective(source_dir):
    """The guard used on reload really intercepts quantization (so the reload checks above mean something)."""
    with pytest.MonkeyPatch.context() as mp:
        calls = forbid_quantize(mp)
        with pytest.raises(Exception):
            quantize_on_load(source_dir("llama"))
    assert calls, "the guard did not see the on-the-fly quantization"


def test_fake_hub_rejects_unknown_endpoints():
    """The fake answers 400 (and records it) to anything it does not implement, so a push cannot pass by accident."""
    import urllib.error
    import urllib.request

    def status(req) -> int:
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    with FakeHub(token=TOKEN) as fake:
        assert status(f"{fake.endpoint}/api/whoami-v2") == 400
        assert status(urllib.request.Request(f"{fake.endpoint}/api/models/user/x/commit/main", data=b"{}",
                                             headers={"Authorization": "Bearer wrong"})) == 400
        assert status(urllib.request.Request(f"{fake.endpoint}/api/repos/create", method="PUT", data=b"{}")) == 400
        assert len(fake.errors) == 3, fake.errors


def test_card_section_says_what_stays_in_full_precision():
    from kbit_hf import KbitConfig
    from kbit_hf.hub import card_section

    default = card_section(KbitConfig(k=4))
    assert "The output head, tied embeddings and MoE routers stay in full precision." in default
    head = card_section(KbitConfig(k=3, quantize_lm_head=True, modules_to_not_convert=["q_proj"]))
    assert "the output head is quantized too" in head
    assert "Tied embeddings and MoE routers stay in full precision, as do: q_proj." in head
