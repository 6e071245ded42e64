"""End to end on a GPU (skipped without one): on-the-fly quantization on the device gives the same bytes as on
the CPU, generation runs, and the saved folder reloads onto the GPU identically."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear, KbitMoE
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt_oss"])
def test_quantize_on_gpu_matches_cpu_and_reloads(family, tmp_path):
    tiny_model(family).save_pretrained(tmp_path / "fp")
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4), device_map="cpu")
    gpu = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=KbitConfig(k=4), device_map="cuda")
    a, b = cpu.state_dict(), gpu.state_dict()
    kbit_keys = [k for k, m in gpu.named_modules() if isinstance(m, (KbitLinear, KbitMoE))]
    assert kbit_keys
    for key in a:
        assert b[key].device.type == "cuda"
        assert torch.equal(a[key], b[key].cpu()), key  # quantization is device independent, bit for bit
    ids = torch.randint(0, VOCAB, (1, 12), device="cuda")
    with torch.no_grad():
        lg = gpu(ids).logits.float()
        lc = cpu(ids.cpu()).logits.float()
    torch.testing.assert_close(lg.cpu(), lc, rtol=0.05, atol=0.05)  # bf16 activations on both, different kernels
    out = gpu.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 20)
    gpu.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cuda")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, gpu(ids).logits)
    assert torch.equal(again.generate(ids, max_new_tokens=8, do_sample=False), out)


def test_default_device_map_puts_the_model_on_the_gpu(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=3))
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "cuda"
