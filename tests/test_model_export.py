"""Writers of ``qkv.models.hf_open`` and ``qkv.models.gguf_model``, held to other readers.

- Hugging Face folders: tiny random models of every family, built with transformers' own
  classes from ``test_hf_open``'s configs, imported by qkv's readers, written by
  ``write_hf_folder`` and loaded by transformers' ``from_pretrained``: the same logits,
  exactly.
- GGUF files: ``test_gguf_model``'s tiny models written by ``write_gguf``: the tensors and
  metadata of that module's reproduction of llama.cpp's converter (compared with the
  gguf package's reader), read back by ``read_gguf_model`` as the original weights,
  loaded by transformers' GGUF loader (logits) and, when llama-cpp-python is installed,
  run by llama.cpp itself (logits within float32 summation error).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import one_line  # noqa: E402
from gguf_files import write_gguf as reference_gguf  # noqa: E402
from qkv.models.gguf_model import read_gguf_model, write_gguf  # noqa: E402
from qkv.models.hf_open import (  # noqa: E402
    config_fields,
    from_qkv,
    hf_config,
    read_open_config,
    read_open_weights,
    to_qkv,
    write_hf_folder,
)
from test_gguf_model import VOCAB, convert, expected_state, tiny  # noqa: E402
from test_hf_open import CASES, CLASSES  # noqa: E402

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
GGUF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "llama3-16", "llama3-8192")


def hf_model(case: str):
    """A transformers model of ``CASES[case]``, every parameter random (Gemma's norms
    start at zero; a tied head would hide a mix-up of the two matrices)."""
    config_dict = CASES[case]
    config_cls, model_cls = CLASSES[config_dict["model_type"]]
    config = getattr(transformers, config_cls).from_dict(copy.deepcopy(config_dict))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def run(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------------------------
# Hugging Face folders


@pytest.mark.parametrize("case", list(CASES))
def test_hf_config_reads_back_as_its_fields(case):
    fields = config_fields(CASES[case], case)
    config = hf_config(fields, CASES[case]["model_type"])
    assert json.loads(json.dumps(config)) == config
    assert config_fields(config, "written") == fields
    # the older RoPE keys alone say the same (transformers 4 reads those)
    older = {k: v for k, v in config.items() if k != "rope_parameters"}
    assert config_fields(older, "older") == fields
    # transformers reads both layouts as the original's RoPE ("type": rope_type's old name)
    original = json.loads(json.dumps(hf_model(case).config.rope_parameters).replace(
        '"type": "linear", ', ""))
    for layout in (config, older):
        assert transformers.AutoConfig.for_model(**layout).rope_parameters == original


@pytest.mark.parametrize("case", list(CASES))
def test_written_folder_loads_in_transformers(tmp_path, case):
    model = hf_model(case)
    model.save_pretrained(tmp_path / "original")
    fields = config_fields(read_open_config(tmp_path / "original"), case)
    state = read_open_weights(tmp_path / "original", fields)
    folder = write_hf_folder(tmp_path / "written", fields, CASES[case]["model_type"], state)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert list(tmp_path.iterdir()) and not [p for p in tmp_path.iterdir()
                                             if p.name.startswith(".")]
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(expected_state(model))  # a tied head once, as the embedding
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is type(model) and loaded.dtype == torch.float32
    ids = torch.arange(30).remainder(64).reshape(1, 30)  # past every case's window
    torch.testing.assert_close(run(loaded, ids), run(model, ids), rtol=0, atol=0)
    # qkv's reader gives the same state dict back
    again = read_open_weights(folder, fields)
    assert set(again) == set(state)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_half_precision_folder_keeps_its_dtype(tmp_path):
    model = hf_model("qwen3")
    fields = config_fields(CASES["qwen3"], "qwen3")
    state = {k: v.bfloat16() for k, v in to_qkv(expected_state(model), fields).items()}
    folder = write_hf_folder(tmp_path / "bf16", fields, "qwen3", state)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == torch.bfloat16
    for name, tensor in expected_state(model).items():
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16()), name


def test_from_qkv_inverts_to_qkv():
    model = hf_model("llama3.2")  # tied
    fields = config_fields(CASES["llama3.2"], "llama3.2")
    want = expected_state(model)
    ours = to_qkv(want, fields)
    assert ours["out_head.weight"] is ours["tok_emb.weight"]
    theirs = from_qkv(ours, fields)
    assert set(theirs) == set(want) and all(theirs[k] is v for k, v in want.items())
    other = {**ours, "out_head.weight": ours["tok_emb.weight"] + 1}
    with pytest.raises(ValueError) as error:
        from_qkv(other, fields)
    one_line(error, "out_head.weight differs from tok_emb.weight", "tie_weights=True")
    missing = {k: v for k, v in ours.items() if k != "trf_blocks.1.att.W_key.weight"}
    with pytest.raises(ValueError) as error:
        from_qkv(missing, fields)
    one_line(error, "missing 1 tensors", "trf_blocks.1.att.W_key.weight")
    wrong = {**ours, "final_norm.scale": torch.ones(3)}
    with pytest.raises(ValueError) as error:
        from_qkv(wrong, fields)
    one_line(error, "final_norm.scale has shape [3]", "from the fields")


@pytest.mark.parametrize("case, model_type, change, match", [
    ("smollm2", "gpt2", {}, "model_type 'gpt2' cannot be written"),
    ("smollm2", "phi3", {}, "model_type 'phi3' cannot be written"),
    ("smollm2", "llama", {"mlp": "gelu"}, "mlp='gelu'"),
    ("smollm2", "llama", {"colour": 1}, "unknown GPTConfig field"),
    ("smollm2", "llama", {"norm_eps": -1.0}, "norm_eps"),
    ("mistral-window", "llama", {},
     "llama config.json: window_size is 16; transformers would run None"),
    ("smollm2", "qwen2", {}, "qwen2 config.json: qkv_bias is False"),
    ("qwen3", "qwen3", {"qk_norm": False}, "qk_norm is False"),
    ("gemma3-1b", "gemma3_text", {"norm": "rmsnorm"}, "norm is 'rmsnorm'"),
    ("gemma3-1b", "gemma3_text", {"embed_scale": False}, "embed_scale is False"),
    ("llama-linear-biases", "llama", {"out_bias": False}, "out_bias is False"),
])
def test_hf_config_refuses_what_the_family_cannot_express(case, model_type, change, match):
    fields = {**config_fields(CASES[case], case), **change}
    with pytest.raises(ValueError) as error:
        hf_config(fields, model_type)
    one_line(error, match)


def test_write_hf_folder_never_overwrites_nor_leaves_a_half_folder(tmp_path, monkeypatch):
    model = hf_model("smollm2")
    fields = config_fields(CASES["smollm2"], "smollm2")
    state = to_qkv(expected_state(model), fields)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for name in ("full", "file"):
        with pytest.raises(FileExistsError) as error:
            write_hf_folder(tmp_path / name, fields, "llama", state)
        one_line(error, str(tmp_path / name), "nothing is overwritten")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # an empty folder is filled
    write_hf_folder(tmp_path / "empty", fields, "llama", state)
    assert (tmp_path / "empty" / "model.safetensors").is_file()

    def fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    before = set(tmp_path.iterdir())
    with pytest.raises(OSError, match="disk full"):
        write_hf_folder(tmp_path / "new", fields, "llama", state)
    assert set(tmp_path.iterdir()) == before  # no folder, no temporary one


# ---------------------------------------------------------------------------------------
# GGUF files


def gguf_model(family: str):
    """``test_gguf_model``'s tiny model of ``family``, the Qwen3 one without its biases
    (llama.cpp's qwen3 has no attn_output.bias: write_gguf refuses it)."""
    model, arch = tiny(family)
    if family == "qwen3":
        model.config.attention_bias = False
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(model.config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape))
    return model, arch


def fields_of(config: dict) -> dict:
    return config_fields(config, "config")


def read_fields(path) -> dict:
    """Every metadata entry of a GGUF file as the gguf package reads it: key -> (types,
    contents)."""
    reader = gguf.GGUFReader(path)
    return {name: (field.types, field.contents()) for name, field in reader.fields.items()}


def read_tensors(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_file_is_what_llama_cpp_converter_writes(tmp_path, family):
    model, arch = gguf_model(family)
    ours = write_gguf(tmp_path / "ours.gguf", model.config.to_dict(), model.state_dict())
    arrays, meta = convert(model, arch)
    theirs = reference_gguf(tmp_path / "theirs.gguf", arrays, arch, meta)
    mine, want = read_tensors(ours), read_tensors(theirs)
    assert set(mine) == set(want)
    for name, (kind, array) in want.items():
        assert mine[name][0] == kind == "F32", name
        assert np.array_equal(mine[name][1], array), name
    meta, want_meta = read_fields(ours), read_fields(theirs)
    for key, value in want_meta.items():
        if key.startswith(f"{arch}.") or key == "general.architecture":
            assert meta[key] == value, key
    assert meta["tokenizer.ggml.model"][1] == "none"


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_gguf_half_precision_weights_and_f32_vectors(tmp_path, dtype):
    model, arch = tiny("gemma3")
    path = write_gguf(tmp_path / "g.gguf", model.config.to_dict(), model.state_dict(), dtype)
    tensors = read_tensors(path)
    arrays = convert(model, arch)[0]
    for name, (kind, array) in tensors.items():
        want = torch.from_numpy(arrays[name])
        if want.dim() == 1:
            assert kind == "F32" and np.array_equal(array, arrays[name]), name
        else:
            assert kind == dtype, name
            bits = torch.from_numpy(array.reshape(-1).view(np.int16).reshape(want.shape))
            assert torch.equal(bits, want.to(DTYPES[dtype]).view(torch.int16)), name
    assert read_fields(path)["general.file_type"][1] == gguf.LlamaFileType[
        {"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}[dtype]]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_reads_back_as_the_model(tmp_path, family, dtype):
    model, _ = gguf_model(family)
    config = model.config.to_dict()
    path = write_gguf(tmp_path / "m.gguf", config, model.state_dict(), dtype)
    back, state = read_gguf_model(path)
    assert fields_of(back) == fields_of(config)
    want = expected_state(model)
    assert set(state) == set(want)
    for name, tensor in want.items():
        rounded = tensor.to(DTYPES[dtype]).float() if tensor.dim() == 2 else tensor
        assert torch.equal(state[name], rounded), name


@pytest.mark.parametrize("family", [f for f in GGUF_FAMILIES if f != "mistral"])
def test_transformers_gguf_loader_undoes_the_conventions(tmp_path, family):
    """transformers' GGUF reader undoes the q/k permutation and Gemma's ``1 + w`` itself.
    (Given a Mistral model, it looks for a gguf-py architecture "mistral", which has none.)"""
    loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    model, _ = gguf_model(family)
    path = write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    theirs = loader.load_gguf_checkpoint(str(path), return_tensors=True,
                                         model_to_load=model)["tensors"]
    for name, tensor in expected_state(model).items():
        assert torch.equal(theirs[name], tensor), name


# Configurations transformers' GGUF loader reads whole: it ignores RoPE scaling, biases,
# Qwen3's head size (128 assumed) and Gemma's query_pre_attn_scalar (256 assumed).
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
PLAIN = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_theta=5e4),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None,
                                                  tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=128),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 7}, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=8),
}


@pytest.mark.parametrize("family", list(PLAIN))
def test_transformers_runs_the_gguf_file(tmp_path, family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(PLAIN[family]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = torch.arange(20).remainder(VOCAB).reshape(1, 20)  # past gemma's window of 8
    torch.testing.assert_close(run(loaded, ids), run(model, ids), rtol=0, atol=0)


def tokenizer_source(path, n_tokens: int):
    """A GGUF file holding a byte-pair tokenizer's metadata, typed as llama.cpp's
    converter types it."""
    tokens = [f"t{i}" for i in range(n_tokens)]
    return reference_gguf(path, {"token_embd.weight": np.zeros((n_tokens, 8), np.float32)},
                          "llama", {
        "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "default",
        "add_token_list": tokens, "add_token_types": [1] * n_tokens,
        "add_token_merges": ["t 1", "t 2"], "add_bos_token_id": 1, "add_eos_token_id": 2,
        "add_add_bos_token": False, "add_chat_template": "{{ messages }}"})


def test_gguf_carries_a_source_files_tokenizer(tmp_path):
    model, _ = gguf_model("qwen3")
    source = tokenizer_source(tmp_path / "source.gguf", VOCAB)
    path = write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict(),
                      tokenizer=source)
    ours, theirs = read_fields(path), read_fields(source)
    keys = [k for k in theirs if k.startswith("tokenizer.")]
    assert len(keys) == 9
    for key in keys:
        assert ours[key] == theirs[key], key
    short = tokenizer_source(tmp_path / "short.gguf", VOCAB - 1)
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "n.gguf", model.config.to_dict(), model.state_dict(),
                   tokenizer=short)
    one_line(error, "47 tokens", "48")
    assert not (tmp_path / "n.gguf").exists()


def gemma_types(config):
    config["layer_types"] = ["sliding_attention", "full_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("family, change, match", [
    ("mistral", lambda c: c.update(sliding_window=16),
     "GGUF llama file: window_size is 16; llama.cpp would run None"),
    ("qwen2", lambda c: c.update(use_sliding_window=True, sliding_window=8,
                                 layer_types=["sliding_attention"] * 2), "window_size is 8"),
    ("gemma3", gemma_types, "layer_types[1] is 'full'; llama.cpp would run 'sliding'"),
    ("gemma3", lambda c: c.update(query_pre_attn_scalar=24), "query_scale is 0.2041"),
    ("qwen3", lambda c: c.update(attention_bias=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "rope_scaling is"),
    ("llama", lambda c: c.update(mlp_bias=True), "mlp_bias is True"),
    ("qwen3", lambda c: None, "attention_bias=True cannot be written to a GGUF qwen3 file"),
    ("llama", lambda c: c.update(model_type="gpt2"), "model_type 'gpt2' cannot be written"),
    ("llama", lambda c: c.update(model_type="phi3"), "model_type 'phi3'"),
])
def test_write_gguf_refuses_what_llama_cpp_cannot_run(tmp_path, family, change, match):
    model, _ = tiny(family)
    config = model.config.to_dict()
    change(config)
    state = model.state_dict()
    if config.get("mlp_bias") or config.get("attention_bias") is False:  # tensors to match
        state = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config)).state_dict()
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", config, state)
    one_line(error, match)
    assert list(tmp_path.iterdir()) == []


def test_write_gguf_refuses_bad_arguments(tmp_path):
    model, _ = tiny("qwen2")
    config, state = model.config.to_dict(), model.state_dict()
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", config, state, "Q8_0")
    one_line(error, "dtype 'Q8_0'", "F32, F16, BF16")
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", config, state)
    one_line(error, "missing 1 tensors", "model.layers.1.mlp.up_proj.weight")
    (tmp_path / "m.gguf").write_bytes(b"mine")
    with pytest.raises(FileExistsError) as error:
        write_gguf(tmp_path / "m.gguf", config, model.state_dict())
    one_line(error, "m.gguf", "nothing is overwritten")
    assert (tmp_path / "m.gguf").read_bytes() == b"mine"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


# ---------------------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python), when installed


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_llama_cpp_runs_the_gguf_file(tmp_path, family):
    llama_cpp = pytest.importorskip("llama_cpp")
    model, _ = gguf_model(family)
    path = write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    # a float32 KV cache (llama.cpp's default is float16): float32 all through
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True,
                          type_k=f32, type_v=f32, verbose=False)
    ids = [i % VOCAB for i in range(3, 23)]  # past gemma's window of 8
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    want = run(model, torch.tensor([ids]))[0]
    scale = float(want.abs().max())  # float32 sums in another order
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4 * scale)


SMOLLM2 = os.environ.get("QKV_SMOLLM2_GGUF")  # .ci/run fetches it; see test_real_models


@pytest.mark.skipif(not SMOLLM2 or not Path(SMOLLM2).is_file(),
                    reason="set QKV_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf")
def test_a_real_model_written_both_ways(tmp_path):
    """SmolLM2-135M from its Q4_1 GGUF, dequantized: written as a folder, transformers
    runs it as the model built from the same weights; written as an F32 GGUF with the
    source's tokenizer, llama.cpp tokenizes the question as the source file does and
    gives the same logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    config, state = read_gguf_model(SMOLLM2)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    fields = config_fields(config, "smollm2")
    folder = write_hf_folder(tmp_path / "hf", fields, "llama", to_qkv(state, fields))
    path = write_gguf(tmp_path / "smol.gguf", config, state, tokenizer=SMOLLM2)
    del state
    source = llama_cpp.Llama(model_path=SMOLLM2, vocab_only=True, verbose=False)
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True,
                          type_k=f32, type_v=f32, verbose=False)
    question = b"What is the capital of France?"
    ids = llm.tokenize(question)
    assert ids == source.tokenize(question) and llm.detokenize(ids) == question
    want = run(model, torch.tensor([ids]))[0]
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    scale = float(want.abs().max())
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4 * scale)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(run(loaded, torch.tensor([ids]))[0], want, rtol=0, atol=0)
