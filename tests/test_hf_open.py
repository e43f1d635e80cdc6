"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3 folders read by ``qkv.models.hf_open``, held
to ``transformers`` itself: each test builds a tiny random model with transformers' own
classes and saves it (nothing downloaded). The expected fields come from the built
modules (their biases, head sizes, windows, RoPE frequencies), the expected names from
the table of the design, written out here."""

from __future__ import annotations

import copy
import json
import math
import re
import struct

import pytest
import torch
import torch.nn.functional as F

from qkv.models.hf_open import (
    SUPPORTED_TYPES,
    config_fields,
    expected_tensors,
    read_open_config,
    read_open_weights,
    to_qkv,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}

# Config objects as models on the Hub save them (older transformers: rope_theta,
# rope_scaling, rope_local_base_freq, sliding_window_pattern; keys left out), their sizes
# shrunk; and some in transformers 5's layout (rope_parameters, layer_types).
CASES = {
    "smollm2": {"model_type": "llama", **SMALL, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
                "rope_theta": 100000, "rope_scaling": None, "tie_word_embeddings": True,
                "attention_bias": False, "mlp_bias": False, "rope_interleaved": False},
    "llama3.2": {"model_type": "llama", **SMALL, "head_dim": 8, "rope_theta": 500000.0,
                 "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 16,
                                  "rope_type": "llama3"},
                 "tie_word_embeddings": True},
    "llama-linear-biases": {"model_type": "llama", **SMALL, "attention_bias": True,
                            "mlp_bias": True, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "llama-new-layout": {"model_type": "llama", **SMALL, "head_dim": 16,
                         "rope_parameters": {"rope_type": "llama3", "rope_theta": 20000.0,
                                             "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0}},
    "mistral-window": {"model_type": "mistral", **SMALL, "sliding_window": 16,
                       "rope_theta": 10000.0, "rms_norm_eps": 1e-5},
    "mistral-no-window": {"model_type": "mistral", **SMALL, "sliding_window": None},
    "qwen2.5": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 4,
                "max_window_layers": 24, "rope_theta": 1e6,
                "sliding_window": 32768, "use_sliding_window": False,
                "tie_word_embeddings": True},
    "qwen2-window": {"model_type": "qwen2", **SMALL, "num_hidden_layers": 3,
                     "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"model_type": "qwen3", **SMALL, "head_dim": 16, "rope_theta": 1000000,
              "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
              "tie_word_embeddings": True},
    "qwen3-biases": {"model_type": "qwen3", **SMALL, "head_dim": 8, "attention_bias": True},
    "gemma3-1b": {"model_type": "gemma3_text", **SMALL, "num_hidden_layers": 4, "head_dim": 16,
                  "num_key_value_heads": 1, "query_pre_attn_scalar": 24,
                  "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                  "sliding_window": 8, "sliding_window_pattern": 3,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma3-4b": {"model_type": "gemma3_text", **SMALL, "num_hidden_layers": 3,
                  "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 4,
                  "sliding_window_pattern": 2, "tie_word_embeddings": False},
    "gemma3-new-layout": {"model_type": "gemma3_text", **SMALL, "num_hidden_layers": 4,
                          "head_dim": 8, "sliding_window": 6,
                          "layer_types": ["sliding_attention", "full_attention",
                                          "full_attention", "sliding_attention"],
                          "rope_parameters": {
                              "full_attention": {"rope_type": "llama3", "rope_theta": 5e5,
                                                 "factor": 4.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 2.0,
                                                 "original_max_position_embeddings": 32},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 2e4}}},
}


def _config(config_dict):
    kind = config_dict["model_type"]
    return getattr(transformers, CLASSES[kind][0]).from_dict(copy.deepcopy(config_dict))


def _model(config_dict, seed=0):
    """A transformers model of ``config_dict``, every parameter random (Gemma's norms
    start at zero, a tied head would hide a mix-up of the two matrices)."""
    config = _config(config_dict)
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[config.model_type][1])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _saved(tmp_path, case, **save):
    model = _model(CASES[case])
    folder = tmp_path / case
    model.save_pretrained(folder, **save)
    return model, folder


def _inv_freq(head_dim, base, scaling):
    """RoPE's inverse frequencies in float64, scaled as the design's rope_scaling says."""
    inv = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    mixed = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < old / high, inv, torch.where(wavelen > old / low,
                                                              inv / factor, mixed))


def _check_against_model(fields, model):
    cfg, body = model.config, model.model
    layer = body.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    d, H = fields["emb_dim"], fields["n_heads"]
    hd = fields["head_dim"] or d // H
    assert (fields["vocab_size"], d) == tuple(body.embed_tokens.weight.shape)
    assert fields["n_layers"] == len(body.layers) and cfg.num_attention_heads == H
    assert fields["context_length"] == cfg.max_position_embeddings
    assert hd == att.head_dim and (fields["head_dim"] is None) == (hd * H == d)
    kv = fields["n_kv_groups"] or H
    assert kv * hd == att.k_proj.out_features and (fields["n_kv_groups"] is None) == (kv == H)
    assert fields["hidden_dim"] == mlp.gate_proj.out_features
    assert fields["qkv_bias"] == (att.q_proj.bias is not None) == (att.v_proj.bias is not None)
    assert fields["out_bias"] == (att.o_proj.bias is not None)
    assert fields["mlp_bias"] == (mlp.gate_proj.bias is not None)
    x = torch.linspace(-4, 4, 101)
    gate = {"swiglu": F.silu, "geglu": lambda v: F.gelu(v, approximate="tanh")}[fields["mlp"]]
    torch.testing.assert_close(mlp.act_fn(x), gate(x))
    # a norm whose weight is zero: x_hat * (1 + 0) for Gemma's, 0 for an RMSNorm
    norm = copy.deepcopy(body.norm)
    with torch.no_grad():
        norm.weight.zero_()
    h = torch.randn(3, d)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    assert fields["norm_eps"] == eps
    x_hat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    want = x_hat if fields["norm"] == "gemma_rmsnorm" else torch.zeros_like(h)
    assert fields["norm"] in ("rmsnorm", "gemma_rmsnorm")
    torch.testing.assert_close(norm(h), want)
    assert fields["post_norms"] == hasattr(layer, "post_feedforward_layernorm")
    assert fields["qk_norm"] == hasattr(att, "q_norm")
    assert math.isclose(fields["query_scale"] or hd ** -0.5, att.scaling, rel_tol=1e-12)
    assert fields["embed_scale"] == hasattr(body.embed_tokens, "embed_scale")
    head = model.lm_head.weight
    assert fields["tie_weights"] == (head.data_ptr() == body.embed_tokens.weight.data_ptr())
    assert fields["drop_rate"] == 0.0 and fields["rope"] is True
    # each layer's window: MistralAttention reads the config's, the others keep their own
    kinds = fields["layer_types"] or ["sliding" if fields["window_size"] else "full"] * len(
        body.layers)
    for kind, block in zip(kinds, body.layers, strict=True):
        theirs = getattr(block.self_attn, "sliding_window", getattr(cfg, "sliding_window", None))
        assert (fields["window_size"] if kind == "sliding" else None) == theirs
    # each layer's RoPE frequencies
    rotary = body.rotary_emb
    for kind, block in zip(kinds, body.layers, strict=True):
        if hasattr(rotary, "inv_freq"):
            theirs = rotary.inv_freq
        else:
            theirs = getattr(rotary, f"{block.self_attn.layer_type}_inv_freq")
        local = kind == "sliding" and fields["rope_local_base"] is not None
        ours = _inv_freq(hd, fields["rope_local_base"], None) if local else _inv_freq(
            hd, fields["rope_base"], fields["rope_scaling"])
        torch.testing.assert_close(theirs.double(), ours, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_config_fields_reproduce_the_transformers_model(tmp_path, case):
    model, folder = _saved(tmp_path, case)
    saved = read_open_config(folder)  # transformers 5's layout, every key written out
    assert "rope_parameters" in saved
    _check_against_model(config_fields(saved, "config.json"), model)
    # the layout the case was written in (the older one for most)
    _check_against_model(config_fields(CASES[case], "config.json"), model)


def test_the_cases_cover_every_field():
    seen = [config_fields(c, "x") for c in CASES.values()]
    assert {f["mlp"] for f in seen} == {"swiglu", "geglu"}
    assert {(f["rope_scaling"] or {}).get("rope_type") for f in seen} == {None, "llama3",
                                                                           "linear"}
    for name in ("qkv_bias", "out_bias", "mlp_bias", "tie_weights", "qk_norm", "post_norms"):
        assert {f[name] for f in seen} == {True, False}, name
    for name in ("n_kv_groups", "head_dim", "window_size", "layer_types", "rope_local_base",
                 "query_scale"):
        assert None in {_hashable(f[name]) for f in seen}
        assert len({_hashable(f[name]) for f in seen}) > 1, name


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize("kind", list(CLASSES))
def test_keys_left_out_take_the_families_defaults(kind):
    cfg = getattr(transformers, CLASSES[kind][0])()
    fields = config_fields({"model_type": kind}, "config.json")
    assert (fields["vocab_size"], fields["emb_dim"], fields["hidden_dim"], fields["n_layers"],
            fields["n_heads"], fields["context_length"]) == (
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
        cfg.num_attention_heads, cfg.max_position_embeddings)
    assert (fields["n_kv_groups"] or fields["n_heads"]) == cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert (fields["head_dim"] or fields["emb_dim"] // fields["n_heads"]) == head_dim
    assert fields["tie_weights"] == cfg.tie_word_embeddings
    assert fields["norm_eps"] == cfg.rms_norm_eps
    layer_types = getattr(cfg, "layer_types", None)
    sliding = getattr(cfg, "sliding_window", None)
    if layer_types is None or sliding is None:
        assert fields["layer_types"] is None
    else:
        assert fields["layer_types"] == [k.split("_")[0] for k in layer_types]
    assert fields["window_size"] == sliding
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    assert fields["rope_base"] == full["rope_theta"] and fields["rope_scaling"] is None
    assert fields["rope_local_base"] == rope.get("sliding_attention", {}).get("rope_theta")


def test_gpt2_configs_go_to_the_gpt2_reader():
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=24, n_layer=2, n_head=4)
    fields = config_fields(cfg.to_dict(), "config.json")
    assert fields == {"vocab_size": 101, "context_length": 32, "emb_dim": 24, "n_heads": 4,
                      "n_layers": 2, "drop_rate": cfg.attn_pdrop, "qkv_bias": True,
                      "tie_weights": True}
    with pytest.raises(ValueError, match="hf_gpt2.read_weights"):
        list(expected_tensors(fields))
    assert "gpt2" in SUPPORTED_TYPES


# The design's table: Hugging Face name -> qkv name.
_SPEC = [
    (r"model\.embed_tokens\.weight", "tok_emb.weight"),
    (r"model\.norm\.weight", "final_norm.scale"),
    (r"lm_head\.weight", "out_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"trf_blocks.\1.norm1.scale"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"trf_blocks.\1.att.W_query.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"trf_blocks.\1.att.W_key.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"trf_blocks.\1.att.W_value.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"trf_blocks.\1.att.out_proj.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"trf_blocks.\1.att.q_norm.scale"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"trf_blocks.\1.att.k_norm.scale"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", r"trf_blocks.\1.norm2.scale"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight",
     r"trf_blocks.\1.post_norm2.scale"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", r"trf_blocks.\1.ff.fc1.\2"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", r"trf_blocks.\1.ff.fc2.\2"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", r"trf_blocks.\1.ff.fc3.\2"),
]


def _spec_name(name, gemma):
    post_attention = r"trf_blocks.\1.post_norm1.scale" if gemma else r"trf_blocks.\1.norm2.scale"
    for pattern, ours in [*_SPEC, (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight",
                                   post_attention)]:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, ours, name)
    raise AssertionError(f"no qkv name for {name}")


def _check_weights(ours, model, fields):
    theirs = model.state_dict()
    gemma = fields["norm"] == "gemma_rmsnorm"
    want = {_spec_name(k, gemma): v for k, v in theirs.items()}
    assert set(ours) == set(want)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    if fields["tie_weights"]:
        assert ours["out_head.weight"] is ours["tok_emb.weight"]
    else:
        assert not torch.equal(ours["out_head.weight"], ours["tok_emb.weight"])
    assert dict(expected_tensors(fields)) == {
        k: tuple(v.shape) for k, v in theirs.items()
        if k != "lm_head.weight" or not fields["tie_weights"]}


@pytest.mark.parametrize("case", ["smollm2", "llama-linear-biases", "mistral-window",
                                  "qwen2-window", "qwen3-biases", "gemma3-1b", "gemma3-4b"])
def test_weights_are_the_models_under_qkv_names(tmp_path, case):
    model, folder = _saved(tmp_path, case)
    fields = config_fields(read_open_config(folder), "config.json")
    _check_weights(read_open_weights(folder, fields), model, fields)
    # to_qkv renames a state dict as it is: the same tensors
    theirs = model.state_dict()
    renamed = to_qkv(theirs, fields)
    gemma = fields["norm"] == "gemma_rmsnorm"
    assert all(renamed[_spec_name(k, gemma)] is v for k, v in theirs.items()
               if k != "lm_head.weight" or not fields["tie_weights"])


def test_shards_listed_by_an_index_read_as_one_file(tmp_path):
    model, folder = _saved(tmp_path, "gemma3-4b", max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file() and len(shards) > 2
    assert not (folder / "model.safetensors").exists()
    fields = config_fields(read_open_config(folder), "config.json")
    _check_weights(read_open_weights(folder, fields), model, fields)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_convert_to_the_dtype_asked(tmp_path, dtype):
    model = _model(CASES["qwen3"]).to(dtype)
    model.save_pretrained(tmp_path)
    fields = config_fields(read_open_config(tmp_path), "config.json")
    model = model.float()
    _check_weights(read_open_weights(tmp_path, fields), model, fields)
    kept = read_open_weights(tmp_path, fields, dtype=dtype)
    assert all(t.dtype == dtype for t in kept.values())
    assert torch.equal(kept["tok_emb.weight"].float(), model.model.embed_tokens.weight)


def test_a_hub_cache_snapshot_of_symlinks_into_its_blobs_reads(tmp_path):
    _, folder = _saved(tmp_path, "qwen3")
    repo = tmp_path / "hub" / "models--owner--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (folder / name).rename(repo / "blobs" / f"blob{i}")
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    fields = config_fields(read_open_config(snapshot), "config.json")
    assert read_open_weights(snapshot, fields)["tok_emb.weight"].shape == (64, 32)
    # a snapshot's link that leaves the repository's cache folder is refused
    outside = tmp_path / "hub" / "elsewhere.safetensors"
    (repo / "blobs" / "blob1").rename(outside)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the model folder .*models--owner--name"):
        read_open_weights(snapshot, fields)


# ---- refusals: one line each, and no tensor data read -------------------------------


@pytest.fixture
def data_reads(monkeypatch):
    """Names of the tensors whose data safetensors was asked for."""
    import safetensors

    real = safetensors.safe_open
    reads = []

    class Counting:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    return reads


def _one_line(error_info):
    text = str(error_info.value)
    assert "\n" not in text
    return text


def _edit_header(path, edit):
    """Rewrite a safetensors file's JSON header through ``edit(header)``, data unchanged."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


def _resave(path, edit):
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def llama(tmp_path):
    _, folder = _saved(tmp_path, "llama-linear-biases")
    return folder, config_fields(read_open_config(folder), "config.json")


def _transpose_gate(header):
    entry = header["model.layers.1.mlp.gate_proj.weight"]
    entry["shape"] = entry["shape"][::-1]


def _int_weights(tensors):
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.int32)


def _infinite(tensors):
    tensors["model.layers.0.self_attn.k_proj.bias"][3] = math.inf


@pytest.mark.parametrize("edit, match", [
    (lambda f: _edit_header(f / "model.safetensors", _transpose_gate),
     r"model.layers.1.mlp.gate_proj.weight has shape \[32, 48\], expected \[48, 32\] from "
     r"config.json"),
    (lambda f: _resave(f / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.bias")),
     r"missing 1 tensors, e.g. 'model.layers.1.mlp.up_proj.bias'"),
    (lambda f: _resave(f / "model.safetensors",
                       lambda t: t.update({"model.layers.2.mlp.up_proj.bias": torch.zeros(48)})),
     r"1 unexpected tensors for this config, e.g. 'model.layers.2.mlp.up_proj.bias'"),
    (lambda f: _resave(f / "model.safetensors", _int_weights),
     r"model.norm.weight holds I32 values; qkv reads F32, F16 or BF16 weights"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64), r"not a safetensors file"),
    (lambda f: (f / "model.safetensors").unlink(),
     r"has neither model.safetensors nor model.safetensors.index.json"),
])
def test_weights_that_disagree_with_the_config_are_refused_unread(llama, data_reads, edit,
                                                                   match):
    folder, fields = llama
    edit(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as error:
        read_open_weights(folder, fields)
    _one_line(error)
    assert data_reads == []


def test_a_size_from_the_config_is_checked_against_the_header_first(llama, data_reads):
    folder, fields = llama
    # 2 billion tokens x 32 would be 256 GB: refused from the header, nothing read
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \[64, 32\], "
                                         r"expected \[2000000000, 32\]"):
        read_open_weights(folder, {**fields, "vocab_size": 2_000_000_000})
    assert data_reads == []


def test_the_budget_is_checked_before_reading(llama, data_reads):
    folder, fields = llama
    total = sum(math.prod(s) for _, s in expected_tensors(fields))
    with pytest.raises(ValueError, match=rf"take {total * 4:,} bytes as torch.float32, more "
                                         rf"than the {total * 4 - 1:,} allowed") as error:
        read_open_weights(folder, fields, max_bytes=total * 4 - 1)
    _one_line(error)
    assert data_reads == []
    assert len(read_open_weights(folder, fields, max_bytes=total * 4)) > 0
    assert len(read_open_weights(folder, fields, dtype=torch.bfloat16, max_bytes=total * 2))


def test_nan_or_infinite_weights_are_named(llama):
    folder, fields = llama
    _resave(folder / "model.safetensors", _infinite)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.bias holds 1 NaN "
                                         r"or infinite value\(s\) of 16"):
        read_open_weights(folder, fields)
    # float32 values past float16's range are infinite once converted
    _, folder = _saved(folder.parent, "qwen3")
    fields = config_fields(read_open_config(folder), "config.json")
    _resave(folder / "model.safetensors",
            lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    with pytest.raises(ValueError, match=r"model.norm.weight holds 1 NaN .* as torch.float16"):
        read_open_weights(folder, fields, dtype=torch.float16)


def test_a_tied_model_may_hold_its_head(tmp_path):
    model, folder = _saved(tmp_path, "smollm2")
    fields = config_fields(read_open_config(folder), "config.json")
    head = model.model.embed_tokens.weight.detach().clone()
    _resave(folder / "model.safetensors", lambda t: t.update({"lm_head.weight": head}))
    _check_weights(read_open_weights(folder, fields), model, fields)
    _resave(folder / "model.safetensors", lambda t: t.update({"lm_head.weight": head[:8]}))
    with pytest.raises(ValueError, match=r"unexpected tensors .* 'lm_head.weight' of shape "
                                         r"\[8, 32\]"):
        read_open_weights(folder, fields)


def test_symlinks_out_of_the_folder_are_refused(llama, tmp_path, data_reads):
    folder, fields = llama
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("model.safetensors", "config.json"):
        (folder / name).rename(outside / name)
        (folder / name).symlink_to(outside / name)
    with pytest.raises(ValueError, match=r"model.safetensors: resolves to .*/outside/model"
                                         r".safetensors, outside the model folder") as error:
        read_open_weights(folder, fields)
    _one_line(error)
    with pytest.raises(ValueError, match=r"config.json: resolves to .* outside the model"):
        read_open_config(folder)
    assert data_reads == []


@pytest.fixture
def shards(tmp_path):
    _, folder = _saved(tmp_path, "qwen2-window", max_shard_size="20KB")
    index = folder / "model.safetensors.index.json"
    names = sorted({*json.loads(index.read_text())["weight_map"].values()})
    assert len(names) > 1
    return folder, index, names, config_fields(read_open_config(folder), "config.json")


def _edit_index(index, edit):
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data))


def test_a_missing_shard_is_named_before_reading(shards, data_reads):
    folder, _, names, fields = shards
    (folder / names[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{names[-1]}: no such file") as error:
        read_open_weights(folder, fields)
    _one_line(error)
    assert data_reads == []


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update({"model.norm.weight": "../model.safetensors"}),
     r"shard '../model.safetensors' must be a .safetensors file directly inside"),
    (lambda m: m.update({"model.norm.weight": "config.json"}),
     r"shard 'config.json' must be a .safetensors file"),
    (lambda m: m.pop("model.norm.weight"),
     r"holds model.norm.weight, which model.safetensors.index.json puts in None"),
    (lambda m: m.update({"model.extra.weight": m["model.norm.weight"]}),
     r"puts model.extra.weight in model-.*, which does not hold it"),
])
def test_an_index_that_disagrees_with_its_shards_is_refused(shards, data_reads, edit, match):
    folder, index, _, fields = shards
    _edit_index(index, edit)
    with pytest.raises(ValueError, match=match) as error:
        read_open_weights(folder, fields)
    _one_line(error)
    assert data_reads == []


def test_a_tensor_in_two_shards_is_refused(shards, data_reads):
    folder, index, names, fields = shards
    home = json.loads(index.read_text())["weight_map"]["model.norm.weight"]
    other = next(name for name in names if name != home)
    _resave(folder / other, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(ValueError, match=r"model.norm.weight is also in|holds model.norm.weight"):
        read_open_weights(folder, fields)
    assert data_reads == []


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "phi3"}, r"model_type 'phi3' is not supported; qkv reads gpt2, llama, "
                             r"mistral, qwen2, qwen3, gemma3_text"),
    ({"model_type": None}, r"model_type None is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     r"config.json: rope_parameters.rope_type='longrope' is not supported; qkv reproduces "
     r"'default', 'linear', 'llama3', 'yarn'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0}},
     r"config.json: rope_parameters: beta_slow \(1.0\) must be below beta_fast \(1.0\)"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"rope_parameters.factor must be a finite "
                                                r"number in \(0.0, inf\), got None"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0}}, r"high_freq_factor \(4.0\) must exceed"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; qkv reproduces 'silu', "
                             r"'gelu_pytorch_tanh'"),
    ({"hidden_size": "32"}, r"config.json: hidden_size must be an integer in "
                            r"\[1, 2147483647\], got '32'"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer"),
    ({"vocab_size": 2**31}, r"vocab_size must be an integer in \[1, 2147483647\]"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                 r"num_key_value_heads \(3\)"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a finite number in \(0.0, inf\), got 0"),
    ({"rope_theta": float("nan"), "rope_scaling": None}, r"rope_theta must be a finite number"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 is not supported"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}},
     r"quantization_config=an object with 1 key\(s\) is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}},
     r"rope_parameters per layer type are read for gemma3_text, olmo3, gemma4_text only, "
     r"not llama"),
])
def test_llama_configs_qkv_cannot_reproduce_are_one_line_errors(changes, match):
    config = {**CASES["llama3.2"], **changes}
    with pytest.raises(ValueError, match=match) as error:
        config_fields(config, "config.json")
    _one_line(error)


@pytest.mark.parametrize("case, changes, match", [
    ("gemma3-1b", {"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0"),
    ("gemma3-1b", {"use_bidirectional_attention": True},
     r"use_bidirectional_attention=True is not supported"),
    ("gemma3-1b", {"layer_types": ["sliding_attention"] * 3},
     r"layer_types must list 4 of 'sliding_attention', 'full_attention', got a list of 3"),
    ("gemma3-1b", {"layer_types": ["chunked_attention"] * 4}, r"layer_types must list 4"),
    ("gemma3-1b", {"sliding_window": None},
     r"sliding_window=None with sliding_attention layers of their own RoPE"),
    ("gemma3-1b", {"sliding_window": 0}, r"sliding_window must be an integer in \[1,"),
    ("gemma3-1b", {"hidden_activation": "relu"}, r"hidden_activation='relu' is not supported"),
    ("gemma3-1b", {"query_pre_attn_scalar": -1}, r"query_pre_attn_scalar must be a finite"),
    ("gemma3-1b", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     r"gemma3_text rope_parameters must map sliding_attention, full_attention"),
    ("gemma3-new-layout", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"RoPE scaling \(linear\) on the sliding_attention layers is not supported"),
    ("qwen2-window", {"max_window_layers": -1}, r"max_window_layers must be an integer in \[0,"),
    ("qwen2-window", {"use_sliding_window": 1}, r"use_sliding_window must be true or false"),
])
def test_other_configs_qkv_cannot_reproduce_are_one_line_errors(case, changes, match):
    with pytest.raises(ValueError, match=match) as error:
        config_fields({**CASES[case], **changes}, "config.json")
    _one_line(error)


def test_config_files_are_read_bounded_with_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        read_open_config(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"config.json: no such file"):
        read_open_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object, got a list"):
        read_open_config(tmp_path)
    path.write_text("[" * 100 + "]" * 100)
    with pytest.raises(ValueError, match=r"config.json: JSON nested more than"):
        read_open_config(tmp_path)
    path.write_text(" " * (1 << 20) + "{}")
    with pytest.raises(ValueError, match=r"is 1,048,578 bytes; at most 1,048,576"):
        read_open_config(tmp_path)
    with pytest.raises(ValueError, match=r"x: expected a JSON object, got a list"):
        config_fields([1], "x")


def test_dangling_and_looping_links_are_refused(llama, tmp_path):
    folder, fields = llama
    weights = folder / "model.safetensors"
    weights.unlink()
    weights.symlink_to(folder / "gone.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model.safetensors: no such file"):
        read_open_weights(folder, fields)
    weights.unlink()
    weights.symlink_to(weights)
    with pytest.raises(ValueError, match=r"model.safetensors: cannot be resolved") as error:
        read_open_weights(folder, fields)
    _one_line(error)


@pytest.mark.parametrize("config, match", [
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8",
                                                           "weight_block_size": [128, 128]}},
     r"quantization_config=an object with 2 key\(s\) is not supported"),
    ({"model_type": "deepseek_v32", "mlp_layer_types": ["dense", "moe"]},
     r"mlp_layer_types must list 'dense' or 'sparse' for each of the 61 layers"),
    ({"model_type": "smollm3", "num_hidden_layers": 2, "no_rope_layers": [1, 2]},
     r"no_rope_layers must list 0 or 1 for each of the 2 layers"),
    ({"model_type": "gpt_oss", "num_local_experts": 0}, r"num_local_experts must be"),
    ({"model_type": "deepseek_v3", "n_group": 3},
     r"n_group \(3\) must divide num_experts \(256\)"),
])
def test_new_family_configs_qkv_cannot_build_are_one_line(config, match):
    """Each family's config fields are checked where they are read, or by the module
    that takes them when the model is built (on the meta device: nothing allocated)."""
    from qkv.models.gpt import GPTConfig

    with pytest.raises(ValueError, match=match) as error:
        GPTConfig(**config_fields(config, "config.json")).meta_model()
    _one_line(error)


@pytest.mark.parametrize("kind, cls", [("qwen3_next", "Qwen3NextConfig"),
                                       ("qwen3_5_text", "Qwen3_5TextConfig")])
@pytest.mark.parametrize("style", ["transformers 4", "left out"])
def test_hybrid_configs_read_as_transformers_reads_them(kind, cls, style):
    """Qwen3-Next's and Qwen3.5's configs as older files spell them (``rope_theta`` and
    ``partial_rotary_factor`` at the top, no ``layer_types``: every
    ``full_attention_interval``-th layer is a full one), or with the keys left out: the
    same layer schedule, turned dimensions, RoPE base and experts as the model
    transformers builds from them."""
    config = {**SMALL, "num_hidden_layers": 8, "head_dim": 32, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 8}
    if style == "transformers 4":
        config.update(full_attention_interval=2, rope_theta=1e6, partial_rotary_factor=0.5,
                      rope_scaling=None)
    if kind == "qwen3_next":
        config.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                      mlp_only_layers=[3], moe_intermediate_size=16,
                      shared_expert_intermediate_size=24)
    theirs = getattr(transformers, cls)(**config)
    fields = config_fields({**config, "model_type": kind}, "config.json")
    kinds = {"linear_attention": "gated_deltanet", "full_attention": "gated"}
    assert [e["attention"] for e in fields["layout"]] == [kinds[t] for t in theirs.layer_types]
    assert len(set(theirs.layer_types)) == 2
    rope = theirs.rope_parameters
    assert fields["attention_options"]["gated"]["rotary_dim"] == int(
        32 * rope["partial_rotary_factor"])
    assert fields["rope_base"] == rope["rope_theta"] and fields["rope_scaling"] is None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(theirs)
    sparse = ["experts" in dict(layer.mlp.named_children()) for layer in model.model.layers]
    assert [e["mlp"] == "moe" for e in fields["layout"]] == sparse
    if kind == "qwen3_next":  # experts in every other layer but layer 3
        assert sparse == [False, True, False, False, False, True, False, True]
    else:
        assert not any(sparse)
    from qkv.models.gpt import GPTConfig
    assert GPTConfig(**fields).num_parameters() == sum(p.numel() for p in model.parameters())
