"""kbit_hf.eval's quality benchmark options on a tiny random model (CPU, no SmolLM2): two texts, calibrated and
mixed-K rows, bitsandbytes / HQQ peers, the JSON file and the plot, and honest bits per weight."""

import importlib.util
import json

import pytest
import torch

from kbit_hf import KbitConfig, KbitLinear, calibrate
from kbit_hf import eval as kev
from tiny_models import byte_tokenizer as _byte_tokenizer, tiny_model

SEQ_LEN = 64



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "fp"
    tiny_model("llama", dtype=torch.float32).save_pretrained(d)
    _byte_tokenizer().save_pretrained(d)
    return str(d)


def _run(folder, tmp_path, *extra):
    argv = ["perplexity", "--model", folder, "--texts", "pydoc", "docstrings", "--max-tokens", "256", "--seq-len",
            str(SEQ_LEN), "--device", "cpu", "--quiet", "--calibration-tokens", "512", "--calibration-seq-len",
            str(SEQ_LEN), "--json", str(tmp_path / "q.json"), *extra]
    rows = kev.main(argv)
    return rows, json.loads((tmp_path / "q.json").read_text())


def test_texts_are_distinct_and_calibration_is_held_out():
    pydoc, docs, calib = kev.eval_text(), kev.heldout_docstrings_text(), kev.calibration_text()
    assert len(docs) > 50_000 and len(calib) > 50_000
    assert len({pydoc, docs, calib}) == 3
    calib_docs = set(calib.split("\n\n"))
    # no held-out docstring paragraph that is long enough to matter also occurs in the calibration text
    shared = [p for p in docs.split("\n\n") if len(p) > 200 and p in calib_docs]
    assert not shared, shared[:2]


def test_kbit_rows_two_texts_json_and_plot(folder, tmp_path, capsys):
    rows, result = _run(folder, tmp_path, "--k", "3", "4", "--calibrated", "3", "--calibrated-mixed",
                        "3:self_attn=5", "--plot", str(tmp_path / "q.png"), "--out", str(tmp_path / "q.md"))
    out = capsys.readouterr().out
    assert [r["config"] for r in rows] == ["fp32", "K=3", "K=4", "K=3", "K=3 (self_attn K=5)"]
    assert [r["method"] for r in rows] == ["unquantized"] + ["kbit round to nearest"] * 2 + ["kbit calibrated"] * 2
    assert set(result["texts"]) == {"pydoc", "docstrings"}
    for r in result["rows"]:
        assert set(r["ppl"]) == {"pydoc", "docstrings"} and all(v > 1 for v in r["ppl"].values())
        assert r["ratio"]["pydoc"] == pytest.approx(r["ppl"]["pydoc"] / result["rows"][0]["ppl"]["pydoc"])
    bits = [r["bits"] for r in rows]
    assert bits[0] == 32 and bits[1] == bits[3] and bits[2] > bits[1]
    # tiny model: q/k/v/o are 64x64 and the MLP 64x100 / 100x64, so K=5 attention adds 2 bits on 4*4096 of
    # 4*4096 + 3*6400 weights (block padding of the 100-wide down_proj included in the measured figure)
    assert bits[3] < bits[4] < bits[3] + 2
    assert rows[3]["calibration_s"] > 0 and "calibration" in result and result["calibration"]["n_tokens"] == 512
    assert (tmp_path / "q.png").stat().st_size > 1000
    assert "| method | configuration | bits per weight | pydoc perplexity | ratio | docstrings perplexity |" in out
    assert "kbit calibrated" in (tmp_path / "q.md").read_text()


def test_calibration_text_must_not_be_an_evaluation_text(folder, tmp_path):
    path = tmp_path / "pydoc.txt"
    path.write_text(kev.eval_text())
    with pytest.raises(ValueError, match="calibration text is the evaluation text"):
        _run(folder, tmp_path, "--k", "--calibrated", "4", "--calibration", str(path))


def test_bad_peer_spec_is_a_usage_error(folder, tmp_path):
    with pytest.raises(SystemExit):
        _run(folder, tmp_path, "--k", "--bnb", "nf5/64")
    with pytest.raises(SystemExit):
        _run(folder, tmp_path, "--k", "--hqq", "4")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_bitsandbytes_rows(folder, tmp_path):
    rows, _ = _run(folder, tmp_path, "--k", "4", "--bnb", "nf4/64", "fp4/32", "nf4-dq/64")
    by = {r["config"]: r for r in rows}
    # measured from the stored tensors: 4-bit codes, a float32 absmax per block, the 16-entry float32 code table
    # per weight (it weighs on a tiny model: 512 bits per matrix of 4096-6400 weights)
    sizes = [m.weight.numel() for m in kev._peer_linears(tiny_model("llama", dtype=torch.float32))]
    for name, bs in (("NF4 blocksize 64", 64), ("FP4 blocksize 32", 32)):
        expected = sum(4 * n + 32 * -(-n // bs) + 16 * 32 for n in sizes) / sum(sizes)
        assert by[name]["bits"] == pytest.approx(expected), name
    # double quant: 8-bit absmax, a float32 absmax per 256 of them, a float32 offset and the 256-entry second table
    expected = sum(4 * n + 8 * -(-n // 64) + 32 * -(-n // (64 * 256)) + 32 + 16 * 32 + 256 * 32
                   for n in sizes) / sum(sizes)
    assert by["NF4 double quant blocksize 64"]["bits"] == pytest.approx(expected)
    fp = rows[0]["ppl"]["pydoc"]
    assert all(abs(r["ppl"]["pydoc"] / fp - 1) < 0.5 for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_bnb_round_trip_is_bitsandbytes_own():
    import bitsandbytes.functional as bnbf

    model = tiny_model("llama", dtype=torch.float32)
    w = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    kev.bnb_quantize_(model, "nf4", 64)
    q, st = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, bnbf.dequantize_4bit(q, st))
    assert torch.equal(model.lm_head.weight, tiny_model("llama", dtype=torch.float32).lm_head.weight)  # head kept


@pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="needs hqq")
def test_hqq_rows(folder, tmp_path):
    rows, _ = _run(folder, tmp_path, "--k", "--hqq", "4/64", "3/32", "2/64")
    by = {r["config"]: r for r in rows}
    assert by["4-bit group 64"]["bits"] == 4.5 and by["3-bit group 32"]["bits"] == 4.0
    assert by["2-bit group 64"]["bits"] == 2.5
    assert by["3-bit group 32"]["stored_bits"] >= 4.0  # 10 3-bit values per int32
    # a random model's perplexity says little: the weight error does (HQQ's own round trip, more bits, less error)
    errors = {}
    for nbits in (2, 4):
        model = tiny_model("llama", dtype=torch.float32)
        w = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        kev.hqq_quantize_(model, nbits, 64)
        q = model.model.layers[0].mlp.up_proj.weight
        errors[nbits] = float((q - w).norm() / w.norm())
    assert 0 < errors[4] < 0.15 < errors[2] < 0.6, errors


def test_calibrate_module_k_matches_from_pretrained_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama", dtype=torch.float32)
    config = KbitConfig(k=3, module_k={"self_attn": 5, "self_attn.v_proj": 4})
    ids = torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(0))
    q = calibrate.quantize(model, config, calibration=ids, n_tokens=512, seq_len=SEQ_LEN, progress=False,
                           out=tmp_path / "q")
    layer = q.model.layers[0]
    assert layer.self_attn.q_proj.k == 5 and layer.self_attn.v_proj.k == 4 and layer.mlp.up_proj.k == 3
    assert layer.self_attn.q_proj.weight_codebook.numel() == 32
    # q/k/v share an input but v_proj has its own k: encoded apart, each group reports its k
    assert {tuple(g["modules"]): g["k"] for g in q.kbit_calibration["groups"]}[
        ("model.layers.0.self_attn.v_proj",)] == 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert isinstance(loaded.model.layers[0].self_attn.v_proj, KbitLinear)
    assert loaded.model.layers[0].self_attn.v_proj.k == 4
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, q(x).logits, atol=1e-5)
