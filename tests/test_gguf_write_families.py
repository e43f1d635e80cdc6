"""``write_gguf`` on the families of mixed layers: gpt-oss (``gpt-oss``), Qwen3.5
(``qwen35``), DeepSeek-V3 (``deepseek2``, the MLA form: ``attn_k_b``/``attn_v_b``),
DeepSeek-V3.2 (``deepseek32``: the same plus the lightning indexer), Qwen3-Next
(``qwen3next``: ``attn_qkv``/``attn_gate``) and Gemma 4 (``gemma4``), against
transformers and llama.cpp's converter.

Each family's tiny model is the one its GGUF reader's tests build with transformers'
classes (``test_gguf_families``, ``test_gguf_hybrids``: the shapes llama.cpp runs, e.g.
gpt-oss's YaRN with its correction range rounded out, as llama.cpp computes it; Qwen3.5's
value heads as wide as its key heads, as llama.cpp's loader takes them; Gemma 4's layers
before the shared ones ending sliding, full, as llama.cpp shares caches). Written by
``write_gguf``:

- its architecture is llama.cpp's, and its metadata says what the converter's does;
- every tensor of the file is the array the small converter of those tests (their
  ``convert``, llama.cpp's ``convert_hf_to_gguf.py`` conventions) writes, bit for bit
  in float32, under the same names;
- ``read_gguf_model`` of the file gives back transformers' state dict, bit-equal where
  stored as it is, within float32 rounding where transformed (the hybrids' norms as
  ``1 + w``, ``A_log`` as ``-exp(A_log)``), and its ``GPTConfig`` fields;
- ``qkv lm import`` of the file runs like the transformers model (logits within 1e-4).

llama.cpp itself runs these files in ``test_gguf_write_llama_cpp`` (when installed).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import test_gguf_families  # noqa: E402
import test_gguf_hybrids  # noqa: E402
from gguf_files import one_line  # noqa: E402
from gguf_files import write_gguf as reference_gguf  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.models.gguf_model import read_gguf_model, write_gguf  # noqa: E402
from qkv.models.gguf_weights import read_gguf_header, read_gguf_tensors  # noqa: E402
from qkv.models.hf_open import config_fields, from_qkv, to_qkv  # noqa: E402
from qkv.tasks.lm import LanguageModel  # noqa: E402
from test_open_models import GEMMA4, VOCAB, perturbed_model  # noqa: E402
from test_open_models import hf_model as open_model  # noqa: E402


def gemma4_as_llama_cpp_shares(family: str = "gemma4_text", seed: int = 0):
    """test_open_models' Gemma 4 (matrices but the embedding scaled up 4 times, norms
    moved), its layers sliding, sliding, full, then the two shared ones sliding, full:
    llama.cpp gives a shared sliding layer the cache of the second-last layer before the
    shared ones, a full one the last's, which transformers' rule (the last earlier layer
    of its kind) then gives too."""
    kinds = ["sliding_attention", "sliding_attention", "full_attention",
             "sliding_attention", "full_attention"]
    return perturbed_model(transformers.Gemma4TextConfig(**{**GEMMA4, "layer_types": kinds}),
                           seed)


# family -> (its tiny transformers model, the converter that is the spec of its GGUF
# form, that converter's keyword arguments: gpt-oss's experts unquantized, as write_gguf
# writes them)
SPECS = {"gpt_oss": (test_gguf_families.hf_model, test_gguf_families.convert,
                     {"mxfp4": False}),
         "qwen3_5_text": (test_gguf_hybrids.hf_model, test_gguf_hybrids.convert, {}),
         "deepseek_v3": (test_gguf_families.hf_model, test_gguf_families.convert, {}),
         "deepseek_v32": (test_gguf_families.hf_model, test_gguf_families.convert, {}),
         "qwen3_next": (test_gguf_hybrids.hf_model, test_gguf_hybrids.convert, {}),
         "gemma4_text": (gemma4_as_llama_cpp_shares, test_gguf_families.convert, {})}
HYBRIDS = ("qwen3_5_text", "qwen3_next")
# family -> llama.cpp's architecture for it (convert_hf_to_gguf.py's model_arch)
ARCHITECTURES = {"gpt_oss": "gpt-oss", "qwen3_5_text": "qwen35", "deepseek_v3": "deepseek2",
                 "deepseek_v32": "deepseek32", "qwen3_next": "qwen3next",
                 "gemma4_text": "gemma4"}
# Stored transformed (the hybrids'): w + 1 and -exp(A_log) round in float32 (one unit
# in the last place of values of a few units).
TRANSFORMED = re.compile(r"(layernorm|q_norm|k_norm|model\.norm)\.weight$|A_log$")
ROUNDING = 5e-7
FAMILIES = list(SPECS)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple]:
    """family -> (transformers model, write_gguf's F32 file of it, with the tokenizer of
    a small GGUF file: VOCAB tokens, for qkv lm import)."""
    tokens = reference_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf",
                            {"token_embd.weight": np.zeros((VOCAB, 2), np.float32)}, "llama",
                            {"tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2,
                             "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]})
    out = {}
    for family, (make, _, _) in SPECS.items():
        model = make(family)
        path = tmp_path_factory.mktemp(family) / f"{family}.gguf"
        out[family] = model, write_gguf(path, model.config.to_dict(), model.state_dict(),
                                        tokenizer=tokens)
    out["tokens"] = tokens
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_are_what_llama_cpp_converter_writes(written, family):
    model, path = written[family]
    _, convert, options = SPECS[family]
    arrays, _ = convert(model, family, **options)
    header = read_gguf_header(path)
    assert set(header.tensors) == set(arrays)
    ours = read_gguf_tensors(path, list(arrays), header=header)
    for name, array in arrays.items():
        assert header.tensors[name].type_name == "F32", name
        assert torch.equal(ours[name], torch.from_numpy(array)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_is_what_llama_cpp_converter_writes(written, family, tmp_path):
    """The architecture is llama.cpp's, and every ``{arch}.*`` key the small converter
    writes (through the gguf package's own ``add_*`` writers) has its value (floats as
    float32); write_gguf may say more (``vocab_size``, ...)."""
    model, path = written[family]
    _, convert, options = SPECS[family]
    arrays, meta = convert(model, family, **options)
    arch = ARCHITECTURES[family]
    theirs = read_gguf_header(reference_gguf(tmp_path / "ref.gguf", arrays, arch, meta))
    ours = read_gguf_header(path)
    assert ours.architecture == arch
    assert {k: ours.config.get(k) for k in theirs.config} == theirs.config


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_back_as_the_model(written, family):
    model, path = written[family]
    config, state = read_gguf_model(path)
    assert config_fields(config, "back") == config_fields(model.config.to_dict(), "model")
    want = model.state_dict()
    if model.config.tie_word_embeddings:
        del want["lm_head.weight"]
    assert set(state) == set(want)
    for name, tensor in want.items():
        if TRANSFORMED.search(name) and family in HYBRIDS:
            torch.testing.assert_close(state[name], tensor, atol=ROUNDING, rtol=0)
        else:
            assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_runs_tensors_write_the_same_file(written, family, tmp_path):
    """The tensors as ``from_qkv`` gives a qkv run's (``qkv bench generate --ckpt``):
    experts one per expert, Qwen3-Next's projections split; the same file, byte for
    byte."""
    model, path = written[family]
    config = model.config.to_dict()
    fields = config_fields(config, family)
    state = from_qkv(to_qkv(model.state_dict(), fields, family), fields)
    if family in ("deepseek_v3", "deepseek_v32", "qwen3_next"):  # per expert, not fused
        assert set(state) != set(model.state_dict())
    ours = write_gguf(tmp_path / "m.gguf", config, state, tokenizer=written["tokens"])
    assert ours.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_lm_import_runs_like_transformers(written, family, tmp_path):
    model, path = written[family]
    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    ours = LanguageModel.load(run).model
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids).logits, atol=1e-4, rtol=0)


def test_half_precision_matrices_and_float32_vectors_routers(written, tmp_path):
    """BF16: the 2-D and 3-D weights (the experts too) rounded to bfloat16; vectors,
    biases (gpt-oss's 2-D expert biases too), the router and DeepSeek-V3.2's indexer
    head weights float32, as llama.cpp's converter keeps them."""
    model, _ = written["gpt_oss"]
    path = write_gguf(tmp_path / "b.gguf", model.config.to_dict(), model.state_dict(), "BF16")
    types = {n: t.type_name for n, t in read_gguf_header(path).tensors.items()}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == "BF16"
    assert types["blk.0.ffn_gate_exps.bias"] == types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.attn_sinks.weight"] == types["blk.0.attn_norm.weight"] == "F32"
    _, state = read_gguf_model(path)
    for name, tensor in model.state_dict().items():
        rounded = (tensor.bfloat16().float() if tensor.dim() >= 2 and "bias" not in name
                   and "router" not in name else tensor)
        assert torch.equal(state[name], rounded), name
    # DeepSeek-V3.2's indexer: its head weights (indexer.proj) float32 too, as llama.cpp's
    # converter keeps them; its projections bfloat16
    model, _ = written["deepseek_v32"]
    path = write_gguf(tmp_path / "v32.gguf", model.config.to_dict(), model.state_dict(), "BF16")
    types = {n: t.type_name for n, t in read_gguf_header(path).tensors.items()}
    assert [types[f"blk.1.indexer.{n}"] for n in ("proj.weight", "k_norm.weight",
                                                   "k_norm.bias")] == ["F32"] * 3
    assert types["blk.1.indexer.attn_q_b.weight"] == types["blk.1.indexer.attn_k.weight"] \
        == "BF16"


def test_refuses_what_llama_cpp_would_run_otherwise(written, tmp_path):
    """gpt-oss's YaRN without truncation: llama.cpp always rounds the correction range."""
    model, _ = written["gpt_oss"]
    config = model.config.to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], "truncate": False}
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", config, model.state_dict())
    one_line(error, "cannot be written to a GGUF gpt-oss file",
             "rope_scaling['truncate'] is False; llama.cpp would run True")
    assert list(tmp_path.iterdir()) == []


def test_refuses_value_heads_llama_cpp_cannot_load(tmp_path):
    """Qwen3.5 with value heads wider than its key heads (12 and 8): llama.cpp fails to
    load such a file, so it is not written."""
    model = open_model("qwen3_5_text")
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    one_line(error, "linear_value_head_dim 12", "qwen35", "linear_key_head_dim (8)")
    assert list(tmp_path.iterdir()) == []


def test_refuses_queries_without_q_lora_at_a_layer_count_llama_cpp_misreads(tmp_path):
    """DeepSeek without query compression (q_lora_rank None): llama.cpp's loader takes
    such a model for DeepSeek-V2-Lite by its 26 or 27 layers only, and asks any other
    file for attention.q_lora_rank (it fails to load them); its deepseek32 loader asks
    every file."""
    config = test_gguf_families.CONFIGS["deepseek_v3"]()
    config.q_lora_rank = None
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    one_line(error, f"q_lora_rank=None with num_hidden_layers {config.num_hidden_layers}",
             "deepseek2", "26 or 27")
    # DeepSeek-V3.2: llama.cpp's deepseek32 loader asks every file for q_lora_rank
    model = test_gguf_families.hf_model("deepseek_v32")
    config = {**model.config.to_dict(), "q_lora_rank": None}
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", config, model.state_dict())
    one_line(error, "q_lora_rank=None", "deepseek32", "attention.q_lora_rank")
    assert list(tmp_path.iterdir()) == []


def test_refuses_index_heads_llama_cpp_cannot_rotate(tmp_path):
    """DeepSeek-V3.2 with index heads 16 wide (test_open_models' model): llama.cpp rotates
    each index head by a Hadamard matrix, which it makes only 64, 128, ... wide (ggml's
    mul_mat fails an assertion on such a file), so it is not written."""
    model = open_model("deepseek_v32")
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    one_line(error, "index_head_dim 16", "deepseek32", "powers of two from 64")
    assert list(tmp_path.iterdir()) == []


def test_refuses_sharing_llama_cpp_computes_otherwise(tmp_path):
    """test_open_models' Gemma 4 (sliding, full, sliding, then shared sliding, full):
    llama.cpp would give shared layer 3 the cache of layer 1 (full), not layer 2's."""
    model = open_model("gemma4_text")
    with pytest.raises(ValueError) as error:
        write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    one_line(error, "layer 3 (sliding_attention) shares the cache of layer 2",
             "gives it layer 1's")
    assert list(tmp_path.iterdir()) == []
