"""qkv.models.gguf_model: a GGUF file read back as a Hugging Face config and state dict.

Each family's tiny model is built with transformers' own classes, written as llama.cpp's
converter writes it (the gguf package's tensor names and metadata writers, q/k rows
permuted for ``llama``, Gemma's norms as ``1 + w``, GPT-2's ``Conv1D`` weights
transposed, Llama 3's RoPE scaling as a ``rope_freqs`` tensor of divisors), then read
back: the state dict must equal the original, the config must give transformers the
original's config, and a model built from them the same logits.
transformers' own GGUF reader checks independently that the files are written as
llama.cpp writes them.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import one_line, write_gguf  # noqa: E402
from qkv.models import gguf_model  # noqa: E402
from qkv.models.gguf_model import gguf_config, gguf_state_dict, read_gguf_model  # noqa: E402
from qkv.models.gguf_weights import read_gguf_header  # noqa: E402
from qkv.models.gpt import GPTConfig, GPTModel  # noqa: E402
from qkv.models.hf_open import config_fields, to_qkv  # noqa: E402

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
          "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3,
          "gpt2": gguf.MODEL_ARCH.GPT2}
VOCAB = 48


def tiny(family: str):
    """A small random transformers model of ``family`` and the GGUF architecture that
    llama.cpp gives it."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True,
                                          rms_norm_eps=1e-5, rope_theta=50000.0,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0})
        cls, arch = transformers.LlamaForCausalLM, "llama"
    elif family.startswith("llama3-"):
        # Llama 3.1/3.2's RoPE scaling: (factor, original context, heads' size, base) give
        # divisors in the blend: three of 16 / 2 (original 16, 40 tokens run past it), or
        # as Llama 3.2 1B's three of 64 / 2 with 1s and factors around them.
        factor, original, head_dim, theta = LLAMA3[family]
        config = transformers.LlamaConfig(**{**common, "max_position_embeddings": 16 * original},
                                          head_dim=head_dim, rope_theta=theta,
                                          tie_word_embeddings=True, rope_scaling={
                                              "rope_type": "llama3", "factor": factor,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": original})
        cls, arch = transformers.LlamaForCausalLM, "llama"
    elif family == "mistral":
        config = transformers.MistralConfig(**common, head_dim=16, sliding_window=None,
                                            tie_word_embeddings=True)
        cls, arch = transformers.MistralForCausalLM, "llama"
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                          rope_theta=1_000_000.0)
        cls, arch = transformers.Qwen2ForCausalLM, "qwen2"
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False,
                                          attention_bias=True)
        cls, arch = transformers.Qwen3ForCausalLM, "qwen3"
    elif family == "gemma3":
        # llama.cpp scales queries by head_dim ** -0.5 (below 62 layers), so the original
        # must too; every 6th layer global, a window of 8 tokens.
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 7}, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=8)
        cls, arch = transformers.Gemma3ForCausalLM, "gemma3"
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32,
                                         n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
        cls, arch = transformers.GPT2LMHeadModel, "gpt2"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if arch == "gemma3" and "norm" in name:
                # Multiples of 1/256: 1 + w is exact in float32, w exact in bfloat16, but
                # bfloat16(1 + w) is not: 1 must be subtracted before rounding.
                p.copy_(torch.randint(-200, 200, p.shape) / 256)
            else:
                p.copy_(torch.randn(p.shape))
    return model, arch


LLAMA3 = {"llama3-16": (8.0, 16, 16, 20.0), "llama3-8192": (32.0, 8192, 64, 500_000.0)}


def llama3_divisors(rope: dict, head_dim: int, dtype=torch.float64) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3's RoPE scaling: per
    frequency, the divisor the scaling applies, computed in ``dtype`` (the converter's
    own arithmetic is float32), stored as float32."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    exponents = torch.arange(0, head_dim, 2, dtype=dtype) / head_dim
    wavelength = 2 * math.pi / (1.0 / rope["rope_theta"] ** exponents)
    smooth = (original / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelength < original / high, torch.ones_like(blend),
                           torch.where(wavelength > original / low,
                                       torch.full_like(blend, factor), blend))
    return divisors.to(torch.float32).numpy()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's permutation of q/k rows (LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert(model, arch: str, f16: bool = False):
    """The tensors and metadata llama.cpp's converter writes for ``model``:
    (llama.cpp name -> array, writer method or raw key -> value)."""
    c = model.config
    names = gguf.get_tensor_name_map(ARCHES[arch], c.num_hidden_layers)
    tied = c.tie_word_embeddings
    arrays = {}
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":  # not saved: the embedding serves
            continue
        array = tensor.numpy().copy()
        kind = hf_name.split(".")[-2]
        if arch == "llama" and kind in ("q_proj", "k_proj"):
            array = llama_cpp_permute(array, c.num_attention_heads if kind == "q_proj"
                                      else c.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + 1
        if arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight",
                                                "c_fc.weight")):
            array = array.T
        if f16 and array.ndim == 2:  # llama.cpp keeps 1-D tensors in F32
            array = array.astype(np.float16)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        arrays[name] = np.ascontiguousarray(array)
    meta = {"add_name": type(model).__name__.removesuffix("ForCausalLM"),
            "add_block_count": c.num_hidden_layers,
            "add_embedding_length": c.hidden_size,
            "add_head_count": c.num_attention_heads,
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]}
    if arch == "gpt2":
        meta.update(add_context_length=c.n_positions, add_feed_forward_length=4 * c.n_embd,
                    add_layer_norm_eps=c.layer_norm_epsilon)
        return arrays, meta
    meta.update(add_context_length=c.max_position_embeddings,
                add_feed_forward_length=c.intermediate_size,
                add_head_count_kv=c.num_key_value_heads, add_layer_norm_rms_eps=c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None)  # Qwen2's config.json has none
    if head_dim is not None:
        meta.update(add_key_length=head_dim, add_value_length=head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    meta["add_rope_freq_base"] = rope["rope_theta"]
    if rope["rope_type"] == "linear":
        meta.update(add_rope_scaling_type=gguf.RopeScalingType.LINEAR,
                    add_rope_scaling_factor=rope["factor"])
    if rope["rope_type"] == "llama3":  # no metadata: a tensor of divisors
        arrays["rope_freqs.weight"] = llama3_divisors(rope, head_dim)
    if arch == "llama":
        meta.update(add_vocab_size=c.vocab_size, add_rope_dimension_count=head_dim)
    if arch == "gemma3":
        meta["add_sliding_window"] = c.sliding_window
    return arrays, meta


def write(path, arch: str, arrays: dict, meta: dict):
    return write_gguf(path, arrays, arch, meta)


def expected_state(model) -> dict:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# Config fields compared between the original and transformers' reading of ours.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias",
          "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
          "hidden_act", "hidden_activation", "n_positions", "n_embd", "n_layer", "n_head",
          "n_inner", "layer_norm_epsilon", "activation_function", "model_type")


def check_config(config: dict, original) -> None:
    ours = transformers.AutoConfig.for_model(**config).to_dict()
    want = original.to_dict()
    compared = [k for k in FIELDS if k in want]
    assert len(compared) >= 10
    for key in compared:
        assert ours[key] == want[key], key


def logits(model, config: dict | None = None, state: dict | None = None) -> torch.Tensor:
    if config is not None:
        hf_config = transformers.AutoConfig.for_model(**config)
        model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert unexpected == [] and missing == (["lm_head.weight"] if
                                                hf_config.tie_word_embeddings else [])
        model.tie_weights()
    ids = torch.arange(20).remainder(VOCAB).reshape(1, 20)  # past gemma's window of 8
    with torch.no_grad():
        return model(ids).logits


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", *LLAMA3)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_equals_transformers_model(tmp_path, family):
    model, arch = tiny(family)
    path = write(tmp_path / f"{family}.gguf", arch, *convert(model, arch))
    config, state = read_gguf_model(path)
    want = expected_state(model)
    assert list(state) and set(state) == set(want)
    for name, tensor in want.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    check_config(config, model.config)
    assert config["model_type"] == model.config.model_type
    torch.testing.assert_close(logits(model, config, state), logits(model), rtol=0, atol=0)


def test_config_fields(tmp_path):
    model, arch = tiny("gemma3")
    config = gguf_config(read_gguf_header(write(tmp_path / "g.gguf", arch,
                                                *convert(model, arch))))
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention",
                                                                 "sliding_attention"]
    assert config["sliding_window"] == 8 and config["rope_local_base_freq"] == 10000.0
    assert config["rope_theta"] == 1_000_000.0 and config["rms_norm_eps"] == 1e-6
    assert config["query_pre_attn_scalar"] == 8 and config["tie_word_embeddings"] is True
    model, arch = tiny("llama")
    config = gguf_config(read_gguf_header(write(tmp_path / "l.gguf", arch,
                                                *convert(model, arch))))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["rms_norm_eps"] == 1e-5  # float32 in the file, 1e-05 here
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is True
    model, arch = tiny("qwen2")
    config = gguf_config(read_gguf_header(write(tmp_path / "q.gguf", arch,
                                                *convert(model, arch))))
    assert "attention_bias" not in config and config["rope_scaling"] is None
    arrays, meta = convert(model, arch)
    meta.update(add_rope_scaling_type=gguf.RopeScalingType.YARN, add_rope_scaling_factor=4.0,
                add_rope_scaling_orig_ctx_len=16)
    config = gguf_config(read_gguf_header(write(tmp_path / "y.gguf", arch, arrays, meta)))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert config["rope_scaling"] == yarn
    want = transformers.Qwen2Config(**{**model.config.to_dict(), "rope_parameters": None},
                                    rope_theta=1_000_000.0, rope_scaling=yarn)
    assert (transformers.AutoConfig.for_model(**config).rope_parameters
            == want.rope_parameters)
    meta["add_rope_scaling_type"] = gguf.RopeScalingType.NONE
    config = gguf_config(read_gguf_header(write(tmp_path / "n.gguf", arch, arrays, meta)))
    assert config["rope_scaling"] is None
    model, arch = tiny("gpt2")
    config = gguf_config(read_gguf_header(write(tmp_path / "g2.gguf", arch,
                                                *convert(model, arch))))
    assert config["n_inner"] is None and config["n_positions"] == 64  # 4 * n_embd


def test_f16_file(tmp_path):
    model, arch = tiny("llama")
    path = write(tmp_path / "f16.gguf", arch, *convert(model, arch, f16=True))
    assert read_gguf_header(path).tensors["blk.0.attn_q.weight"].type_name == "F16"
    config, state = read_gguf_model(path)
    for name, tensor in expected_state(model).items():
        want = tensor.half().float() if tensor.dim() == 2 else tensor
        assert torch.equal(state[name], want), name


def test_bfloat16_keeps_gemma_norms(tmp_path):
    model, arch = tiny("gemma3")
    path = write(tmp_path / "g.gguf", arch, *convert(model, arch))
    _, state = read_gguf_model(path, dtype=torch.bfloat16)
    norm = "model.layers.0.post_feedforward_layernorm.weight"
    original = model.state_dict()
    assert not torch.equal((original[norm] + 1).bfloat16() - 1, original[norm].bfloat16())
    for name, tensor in expected_state(model).items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], tensor.bfloat16()), name


def test_max_bytes_passed_through(tmp_path):
    model, arch = tiny("qwen3")
    path = write(tmp_path / "q.gguf", arch, *convert(model, arch))
    total = sum(t.numel() * 4 for t in expected_state(model).values())
    with pytest.raises(ValueError) as error:
        read_gguf_model(path, max_bytes=total - 1)
    one_line(error, f"{total:,} bytes", f"{total - 1:,}")
    assert len(read_gguf_model(path, max_bytes=total)[1]) == len(expected_state(model))
    model, arch = tiny("gemma3")  # bfloat16: the norms are read in float32 first
    path = write(tmp_path / "g.gguf", arch, *convert(model, arch))
    with pytest.raises(ValueError):
        read_gguf_model(path, dtype=torch.bfloat16, max_bytes=1000)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "gemma3", "gpt2", "llama3-16"])
def test_files_read_by_transformers_gguf_loader(tmp_path, family):
    """transformers' own GGUF reader (which undoes llama.cpp's conventions itself) gives
    the original weights back from these files: they are written as llama.cpp writes.
    (``from_pretrained(gguf_file=...)`` needs accelerate, not installed here; this is the
    function it calls.)"""
    loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    model, arch = tiny(family)
    path = write(tmp_path / f"{family}.gguf", arch, *convert(model, arch))
    theirs = loader.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    want = expected_state(model)
    tensors = {k: v for k, v in theirs["tensors"].items() if k in want}
    assert set(tensors) == set(want)
    for name, tensor in want.items():
        assert torch.equal(tensors[name], tensor), name
    ours = read_gguf_model(path)[0]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "n_embd", "n_layer", "n_head", "tie_word_embeddings",
                "sliding_window"):
        if key in theirs["config"]:
            assert ours[key] == theirs["config"][key], key


def test_real_file_shape_of_config(tmp_path):
    """The SmolLM2-135M layout (tied, 9 heads of 64, 3 KV heads): no key_length, the heads'
    size from rope.dimension_count, as llama.cpp writes llama files."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=36, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=9,
                                      num_key_value_heads=3, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    arrays, meta = convert(model, "llama")
    del meta["add_key_length"], meta["add_value_length"]
    config, state = read_gguf_model(write(tmp_path / "s.gguf", "llama", arrays, meta))
    assert config["head_dim"] == 4 and config["tie_word_embeddings"]
    for name, tensor in expected_state(model).items():
        assert torch.equal(state[name], tensor), name


# ---------------------------------------------------------------------------
# Llama 3's RoPE scaling, stored as a rope_freqs tensor


def tamed(family: str):
    """``tiny(family)`` with its matrices scaled by 0.3: logits of about 24 (unit normal
    weights) differ by float32 noise over 1e-4 between any two implementations."""
    model, arch = tiny(family)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(0.3)
    return model, arch


def qkv_logits(config: dict, state: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits of qkv's GPTModel built from a Hugging Face config and state dict."""
    fields = config_fields(config, "gguf")
    model = GPTModel(GPTConfig(**fields)).eval()
    model.load_state_dict(to_qkv(state, fields))
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("family", list(LLAMA3))
def test_llama3_scaling_from_rope_freqs(tmp_path, family):
    model, arch = tamed(family)
    rope = model.config.rope_parameters
    arrays, meta = convert(model, arch)
    divisors = arrays["rope_freqs.weight"]
    factor = rope["factor"]
    assert divisors.max() == factor and ((divisors > 1) & (divisors < factor)).sum() == 3
    assert (divisors == 1).any() == (family == "llama3-8192")
    config, state = read_gguf_model(write(tmp_path / "l3.gguf", arch, arrays, meta))
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert set(state) == set(expected_state(model))  # rope_freqs is the config's now
    # qkv's decoder gives transformers' logits, 40 tokens (past an original 16).
    ids = torch.arange(40).mul(7).remainder(VOCAB).reshape(1, 40)
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(qkv_logits(config, state, ids), want, atol=1e-4, rtol=0)
    # which unscaled RoPE would not give
    unscaled = qkv_logits({**config, "rope_scaling": None}, state, ids)
    assert (unscaled - want).abs().max() > 1e-2
    # llama.cpp's converter computes the divisors in float32 arithmetic: the same config.
    f32 = llama3_divisors(rope, config["head_dim"], torch.float32)
    if family == "llama3-8192":
        assert not np.array_equal(f32, divisors)
    path = write(tmp_path / "f32.gguf", arch, {**arrays, "rope_freqs.weight": f32}, meta)
    assert read_gguf_model(path)[0] == config


def test_llama3_rope_freqs_refused_unless_llama3(tmp_path):
    model, arch = tiny("llama3-8192")
    arrays, meta = convert(model, arch)
    divisors = arrays["rope_freqs.weight"]
    blend = int(np.flatnonzero((divisors > 1) & (divisors < 32))[1])
    for i, value in ((blend, divisors[blend] * 1.001), (0, 1.01), (31, 31.0)):
        tampered = divisors.copy()
        tampered[i] = value
        path = write(tmp_path / f"t{i}.gguf", arch, {**arrays, "rope_freqs.weight": tampered},
                     meta)
        refused(path, "tensor rope_freqs.weight holds RoPE divisors from 1 to 32",
                "no llama3 scaling")
    # another high_freq_factor (llama.cpp would run it; qkv recognises Llama 3.x's 4)
    other = llama3_divisors({**model.config.rope_parameters, "high_freq_factor": 8.0}, 64)
    refused(write(tmp_path / "h8.gguf", arch, {**arrays, "rope_freqs.weight": other}, meta),
            "no llama3 scaling", "high_freq_factor 4")


def test_llama3_rope_freqs_header_refusals(tmp_path, no_reads):
    model, arch = tiny("llama3-16")
    arrays, meta = convert(model, arch)
    short = {**arrays, "rope_freqs.weight": arrays["rope_freqs.weight"][:4].copy()}
    refused(write(tmp_path / "s.gguf", arch, short, meta),
            "tensor rope_freqs.weight has shape [4]", "heads of 16 imply [8]")
    linear = {**meta, "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
              "add_rope_scaling_factor": 2.0}
    refused(write(tmp_path / "two.gguf", arch, arrays, linear),
            "rope.scaling.type is 'linear'", "rope_freqs.weight tensor too")
    # a config saying llama3 needs the tensor; one that does not refuses it
    plain = {k: v for k, v in arrays.items() if k != "rope_freqs.weight"}
    path = write(tmp_path / "plain.gguf", arch, plain, meta)
    header = read_gguf_header(path)
    scaling = dict(model.config.rope_parameters)
    del scaling["rope_theta"]
    with pytest.raises(ValueError) as error:
        gguf_state_dict(path, header, {**gguf_config(header), "rope_scaling": scaling})
    one_line(error, "has no tensor rope_freqs.weight", "rope_scaling (llama3)")
    qwen, _ = tiny("qwen2")
    q_arrays, q_meta = convert(qwen, "qwen2")
    q_arrays["rope_freqs.weight"] = np.ones(4, np.float32)
    refused(write(tmp_path / "q.gguf", "qwen2", q_arrays, q_meta),
            "tensor rope_freqs.weight is not part of a qwen2 model")


def test_lm_import_of_a_llama3_gguf(tmp_path):
    """``qkv lm import`` of such a file: the run gives transformers' logits."""
    from qkv.cli import main
    from qkv.tasks.lm import LanguageModel

    model, arch = tamed("llama3-16")
    arrays, meta = convert(model, arch)
    meta.update({"tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2})
    path = write(tmp_path / "llama3.gguf", arch, arrays, meta)
    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    lm = LanguageModel.load(run)
    assert lm.model.cfg.rope_scaling["original_max_position_embeddings"] == 16
    ids = torch.arange(40).mul(5).remainder(VOCAB).reshape(1, 40)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), model(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------
# Refusals: one line each, before a tensor is read.



@pytest.fixture
def no_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the file was checked")
    monkeypatch.setattr(gguf_model, "read_gguf_tensors", refuse)


def refused(path, *parts: str) -> None:
    with pytest.raises(ValueError) as error:
        read_gguf_model(path)
    one_line(error, str(path), *parts)


def test_refuses_unknown_architecture(tmp_path, no_reads):
    path = write(tmp_path / "phi.gguf", "phi3",
                 {"token_embd.weight": np.ones((4, 8), np.float32)},
                 {"add_block_count": 1})
    refused(path, "'phi3'", "llama, qwen2, qwen3, gemma3, gpt2")


def test_refuses_missing_extra_and_misshapen_tensors(tmp_path, no_reads):
    model, arch = tiny("llama")
    arrays, meta = convert(model, arch)
    missing = dict(arrays)
    del missing["blk.1.ffn_up.weight"]
    refused(write(tmp_path / "missing.gguf", arch, missing, meta),
            "has no tensor blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight")
    extra = {**arrays, "blk.0.ffn_up.bias": np.zeros(40, np.float32)}
    refused(write(tmp_path / "extra.gguf", arch, extra, meta),
            "tensor blk.0.ffn_up.bias is not part of a llama model")
    refused(write(tmp_path / "shape.gguf", arch, arrays, {**meta, "add_feed_forward_length": 41}),
            "tensor blk.0.ffn_gate.weight has shape [40, 32]", "implies [41, 32]")
    gpt2, _ = tiny("gpt2")
    g_arrays, g_meta = convert(gpt2, "gpt2")
    g_arrays["blk.0.attn_qkv.weight"] = g_arrays["blk.0.attn_qkv.weight"].T.copy()
    refused(write(tmp_path / "conv1d.gguf", "gpt2", g_arrays, g_meta),
            "tensor blk.0.attn_qkv.weight has shape [32, 96]", "implies [96, 32]")


def test_refuses_lying_counts(tmp_path, no_reads):
    model, arch = tiny("llama")
    arrays, meta = convert(model, arch)
    refused(write(tmp_path / "huge.gguf", arch, arrays, {**meta, "add_block_count": 10**9}),
            "block_count is 1,000,000,000", f"only {len(arrays)} tensors")
    refused(write(tmp_path / "more.gguf", arch, arrays, {**meta, "add_block_count": 3}),
            "has no tensor blk.2.attn_norm.weight")
    refused(write(tmp_path / "fewer.gguf", arch, arrays, {**meta, "add_block_count": 1}),
            "tensor blk.1.attn_q.weight is not part of", "(13 such")
    refused(write(tmp_path / "vocab.gguf", arch, arrays, {**meta, "add_vocab_size": 50}),
            "vocab_size is 50", "48 rows")
    good = write(tmp_path / "good.gguf", arch, arrays, meta)
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, 8, 2**40)  # the header's tensor count
    (tmp_path / "count.gguf").write_bytes(bytes(data))
    refused(tmp_path / "count.gguf", "tensor count")


def test_refuses_bad_metadata(tmp_path, no_reads):
    model, arch = tiny("llama")
    arrays, meta = convert(model, arch)
    no_eps = {k: v for k, v in meta.items() if k != "add_layer_norm_rms_eps"}
    refused(write(tmp_path / "eps.gguf", arch, arrays, no_eps),
            "llama.attention.layer_norm_rms_epsilon is missing")
    refused(write(tmp_path / "kv.gguf", arch, arrays, {**meta, "add_head_count_kv": 3}),
            "attention.head_count 4 is not a multiple of attention.head_count_kv 3")
    refused(write(tmp_path / "rot.gguf", arch, arrays, {**meta, "add_rope_dimension_count": 4}),
            "rope.dimension_count is 4", "partial rotary")
    refused(write(tmp_path / "yarn.gguf", arch, arrays,
                  {**meta, "llama.rope.scaling.mystery": 1.5}),
            "rope.scaling.mystery is not understood")
    refused(write(tmp_path / "zero.gguf", arch, arrays, {**meta, "add_head_count": 0}),
            "llama.attention.head_count must be an integer")


def test_state_dict_checks_config_against_header(tmp_path, no_reads):
    """A config that is not the file's (another family's) is refused by name."""
    model, arch = tiny("qwen3")
    path = write(tmp_path / "q.gguf", arch, *convert(model, arch))
    header = read_gguf_header(path)
    config = {**gguf_config(header), "model_type": "gemma3_text"}
    with pytest.raises(ValueError) as error:
        gguf_state_dict(path, header, config)
    one_line(error, "has no tensor blk.0.post_attention_norm.weight", "gemma3_text")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"])
def test_lm_import_of_each_family_runs_like_transformers(tmp_path, family):
    """Every family as a GGUF file through ``qkv lm import``: logits within 1e-4 of the
    transformers model it was written from, and 20 greedy tokens equal to its
    ``generate``, with and without the KV cache (Gemma's 24 tokens run past its window
    of 8)."""
    from qkv.cli import main
    from qkv.models.gpt import generate
    from qkv.tasks.lm import LanguageModel

    model, arch = tamed(family)
    arrays, meta = convert(model, arch)
    meta.update({"tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2})
    path = write(tmp_path / f"{family}.gguf", arch, arrays, meta)
    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    lm = LanguageModel.load(run)
    ids = torch.arange(40).mul(7).remainder(VOCAB).reshape(1, 40)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), model(ids).logits, atol=1e-4, rtol=0)
    prompt = ids[:, :4]
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    for use_cache in (True, False):
        assert generate(lm.model, prompt, 20, use_cache=use_cache).tolist() == want.tolist()


def _k_blocks(qtype, shape: tuple[int, int], scales: dict[int, float], seed: int):
    """Random ``qtype`` blocks for a ``(rows, cols)`` weight, each float16 scale field (byte
    offset -> largest magnitude) drawn small, so the weights are of a trained model's
    size: gguf's numpy code cannot quantize the K types, so their blocks are made here."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at, top in scales.items():
        raw[:, at:at + 2] = np.frombuffer(rng.uniform(-top, top, len(raw)).astype("<f2")
                                          .tobytes(), np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size), qtype


def test_lm_import_of_a_file_of_mixed_quantizations(tmp_path, capsys):
    """A Llama 256 wide written as llama.cpp's quantizer mixes a Q4_K_M file (Q4_K for most
    matrices, Q6_K for the output and some down and value projections, Q5_0 and Q8_0
    where its rules fall back): ``qkv lm import`` gives the logits transformers' own GGUF
    loader gives on the same file, and prints the file's mix of types."""
    loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from collections import Counter

    from qkv.cli import main
    from qkv.tasks.lm import LanguageModel

    Q = gguf.GGMLQuantizationType
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    arrays, meta = convert(original, "llama")
    meta.update({"tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2})
    plan = {"token_embd.weight": Q.Q5_0, "output.weight": Q.Q6_K}
    for i in range(2):
        plan.update({f"blk.{i}.attn_q.weight": Q.Q4_K, f"blk.{i}.attn_k.weight": Q.Q4_K,
                     f"blk.{i}.attn_v.weight": (Q.Q6_K, Q.Q8_0)[i],
                     f"blk.{i}.attn_output.weight": Q.Q4_K,
                     f"blk.{i}.ffn_gate.weight": Q.Q4_K, f"blk.{i}.ffn_up.weight": Q.Q4_K,
                     f"blk.{i}.ffn_down.weight": (Q.Q6_K, Q.Q5_0)[i]})
    for seed, (name, qtype) in enumerate(plan.items()):
        if qtype == Q.Q4_K:
            arrays[name] = _k_blocks(qtype, arrays[name].shape, {0: 1e-4, 2: 1e-4}, seed)
        elif qtype == Q.Q6_K:
            arrays[name] = _k_blocks(qtype, arrays[name].shape, {208: 2e-5}, seed)
        else:
            arrays[name] = (gguf.quants.quantize(arrays[name], qtype), qtype)
    path = write(tmp_path / "mixed.gguf", "llama", arrays, meta)
    types = Counter(t.name for t in plan.values())
    types["F32"] = len(arrays) - len(plan)
    mix = ", ".join(f"{name} x {n}" for name, n in types.most_common())
    assert mix.startswith("Q4_K x 10, F32 x 5")

    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    assert f"tensors in the file: {mix}\n" in capsys.readouterr().out
    ids = torch.arange(24).mul(5).remainder(VOCAB).reshape(1, 24)
    with torch.no_grad():
        ours = LanguageModel.load(run).model(ids)
    theirs = loader.load_gguf_checkpoint(str(path), return_tensors=True,
                                         model_to_load=original)["tensors"]
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.load_state_dict(theirs, strict=True)
    with torch.no_grad():
        want = reference(ids).logits
    assert want.abs().max() > 0.1  # the quantized weights carry signal
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-4)
