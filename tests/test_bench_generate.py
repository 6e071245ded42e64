"""The generation benchmark runs end to end on a tiny shape (CPU, eager) and reports what it measured."""

import json
import os

import pytest
import torch

from kbit_hf.bench import generate
from kbit_hf.bench.__main__ import main


def test_generate_benchmark_tiny_cpu(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["generate", "--model", "tiny-qwen3-moe", "--methods", "bf16,kbit4,kbit2-head", "--modes", "eager,static",
               "--batch", "1,3", "--prompt-len", "8", "--new-tokens", "5", "--device", "cpu",
               "--workdir", str(tmp_path / "ckpt"), "--json", str(out_json), "--png", str(out_png)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["model"] == "tiny-qwen3-moe-2L" and report["device"] == "cpu"
    by = {r["method"]: r for r in report["results"]}
    assert set(by) == {"bf16", "kbit4", "kbit2-head"}
    for res in by.values():
        assert "error" not in res and res["load_s"] > 0
        assert [(r["mode"], r["batch"]) for r in res["runs"]] == [("eager", 1), ("eager", 3), ("static", 1),
                                                                  ("static", 3)]
        for r in res["runs"]:
            assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_ms"] > 0
            assert r["warm_tokens_equal"]  # greedy decoding is deterministic: warm-up and timed run agree
            if r["mode"] == "static":  # on CPU generate does not compile: the static cache alone, same logits
                assert r["static_vs_eager_logit_rel_err"] < 1e-2
    assert out_png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "decode tok/s" in printed and "kbit4" in printed
    # the checkpoint is written once and reused
    folder = tmp_path / "ckpt" / "tiny-qwen3-moe-2L"
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert generate.ensure_checkpoint("tiny-qwen3-moe", None, str(tmp_path / "ckpt"), "cpu") == str(folder)
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    # plot subcommand redraws from the JSON
    assert main(["plot", str(out_json), str(tmp_path / "again.png")]) == 0


def test_generate_benchmark_keeps_each_finished_run(tmp_path, monkeypatch):
    """The JSON holds every measured run as soon as it is measured: a process killed mid-method loses only its
    current run."""
    out_json = tmp_path / "r.json"
    real, calls = generate.measure, []

    def measure_then_die(*a, **kw):
        calls.append(kw["batch"])
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands in for a kill: nothing after this point runs
        return real(*a, **kw)

    monkeypatch.setattr(generate, "measure", measure_then_die)
    with pytest.raises(KeyboardInterrupt):
        main(["generate", "--model", "tiny-qwen3-moe", "--methods", "bf16", "--modes", "eager", "--batch", "1,2",
              "--prompt-len", "8", "--new-tokens", "3", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
              "--json", str(out_json)])
    report = json.loads(out_json.read_text())
    assert [r["method"] for r in report["results"]] == ["bf16"]
    assert [(r["mode"], r["batch"]) for r in report["results"][0]["runs"]] == [("eager", 1)]
    assert report["results"][0]["runs"][0]["decode_tok_s"] > 0


def test_generate_benchmark_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown method 'kbit7'"):
        generate.parse_methods("bf16,kbit7")
    with pytest.raises(ValueError, match="unknown model shape 'llama-9b'"):
        generate.shape_config("llama-9b")
    with pytest.raises(ValueError, match="--layers must be >= 1"):
        generate.shape_config("llama-3-8b", 0)
    cfg = generate.shape_config("llama-3-70b", 4)
    assert cfg.num_hidden_layers == 4 and cfg.hidden_size == 8192
    assert generate.parse_methods("kbit5-head")[0].quantization_config().quantize_lm_head
    assert not generate.parse_methods("kbit5")[0].quantization_config().quantize_lm_head
    with pytest.raises(ValueError, match="unknown method 'kbit4-heads'"):
        generate.parse_methods("kbit4-heads")
    m = generate.parse_methods("bnb-nf4")[0]
    assert m.name == "bnb-nf4"  # unavailable methods are reported, not fatal


def test_defer_stop_patch_is_scoped():
    """--defer-stop: DeferredStopCheck is allowed on CUDA inside the block only, with transformers' other conditions."""
    import torch
    from transformers.generation import utils as gen_utils

    cls = gen_utils.DeferredStopCheck
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    class Cache:
        is_croppable = False

    assert not cls.is_supported(cuda, None, False, False)  # transformers' own rule: mps only
    with generate.deferred_stop_on_cuda():
        assert cls.is_supported(cuda, None, False, False)
        assert cls.is_supported(cuda, Cache(), False, False)  # the cache is not returned: nothing to roll back
        assert not cls.is_supported(cuda, Cache(), True, False)  # a returned cache that cannot be cropped
        assert not cls.is_supported(cuda, None, False, True)  # assistant models
        assert not cls.is_supported(cpu, None, False, False)
    assert not cls.is_supported(cuda, None, False, False)


def test_table_hides_first_token_times_under_defer_stop():
    """With --defer-stop tokens reach the streamer a step late: the table prints no TTFT / prefill figures then."""
    run = {"mode": "static", "batch": 1, "ttft_ms": 12.5, "prefill_tok_s": 5120.0, "decode_tok_s": 100.0,
           "e2e_tok_s": 90.0, "peak_gen_bytes": 0, "warmup_s": 1.0}
    res = {"method": "bf16", "load_s": 1.0, "resident_bytes": 0, "load_peak_bytes": 0, "runs": [run]}
    plain = generate.table({"results": [res], "defer_stop": False})
    deferred = generate.table({"results": [res], "defer_stop": True})
    assert "12.5" in plain and "5120" in plain
    assert "12.5" not in deferred and "5120" not in deferred and "100.0" in deferred


def test_train_benchmark_tiny_cpu(tmp_path, capsys):
    """`kbit-bench train`: a LoRA step on a tiny shape for bf16 and kbit, tokens/s and a finite loss for each."""
    pytest.importorskip("peft")
    out_json = tmp_path / "t.json"
    rc = main(["train", "--model", "tiny-llama", "--methods", "bf16,kbit4", "--batch", "2", "--seq-len", "16",
               "--steps", "2", "--warmup", "1", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"),
               "--json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    by = {m["method"]: m for m in report["methods"]}
    assert set(by) == {"bf16", "kbit4"}
    for m in by.values():
        assert "error" not in m, m
        assert m["tokens_per_s"] > 0 and m["trainable"] > 0 and m["loss"] == m["loss"]
    assert by["kbit4"]["trainable"] == by["bf16"]["trainable"]  # the same adapters on the same layers
    assert "tokens/s" in capsys.readouterr().out


def test_calibrate_benchmark_tiny_cpu(tmp_path, capsys):
    """`kbit-bench calibrate`: calibrated quantization of a tiny shape, its time reported."""
    out_json = tmp_path / "c.json"
    rc = main(["calibrate", "--model", "tiny-llama", "--k", "3", "--tokens", "256", "--seq-len", "64", "--device",
               "cpu", "--workdir", str(tmp_path / "ckpt"), "--json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert report["layers"] == 2 and report["seconds"] > 0 and report["k"] == 3
    assert "calibrated K=3" in capsys.readouterr().out


def test_checkpoint_of_a_model_too_large_to_convert_on_the_device(tmp_path, monkeypatch, capsys):
    """Where save_pretrained runs out of device memory (its per-expert conversion), the benchmark writes the model's
    own tensor names in shards instead; from_pretrained loads them to the same model, bf16 and quantized."""
    import transformers
    from transformers import AutoModelForCausalLM

    from kbit_hf import KbitConfig

    reference = generate.ensure_checkpoint("tiny-qwen3-moe", None, str(tmp_path / "converted"), "cpu")

    def out_of_memory(self, folder, *args, **kwargs):
        with open(os.path.join(folder, "model-00001-of-00002.safetensors"), "w") as f:
            f.write("a partial shard")
        raise torch.OutOfMemoryError("pretended")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", out_of_memory)
    monkeypatch.setattr(generate, "SHARD_BYTES", 1 << 16)
    folder = generate.ensure_checkpoint("tiny-qwen3-moe", None, str(tmp_path / "own"), "cpu")
    monkeypatch.undo()
    assert "ran out of device memory" in capsys.readouterr().err  # the fallback says so
    files = sorted(os.listdir(folder))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    assert "model-00001-of-00002.safetensors" not in files  # the failed save's files are gone
    ids = torch.randint(0, 100, (1, 6))
    for kwargs in ({}, {"quantization_config": KbitConfig(k=4)}):
        a = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16, device_map="cpu", **kwargs)
        b = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu", **kwargs)
        with torch.no_grad():
            assert torch.equal(a(ids).logits, b(ids).logits)
