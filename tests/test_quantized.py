"""Quantized runs: GGUF blocks kept as the file holds them (``qkv lm import --keep-quantized``).

``QuantizedLinear`` is held to the gguf package's own ``gguf.quants.dequantize`` followed
by a float64 product written here; a tiny Llama written as a GGUF file of mixed types,
imported with ``--keep-quantized``, must give the logits and greedy tokens of its float32
import; the run must reload, resume generating, and refuse a tampered type or shape or
a damaged block in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from gguf_files import write_gguf  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.kernels import decode_kernels, unavailable_reason  # noqa: E402
from qkv.models.gguf_weights import read_gguf_header  # noqa: E402
from qkv.models.gpt import GPTConfig, GPTModel, generate, native_unsupported  # noqa: E402
from qkv.models.quantized import (  # noqa: E402
    KEPT_TYPES,
    QuantizedEmbedding,
    QuantizedLinear,
    quantized_modules,
    quantized_types,
)
from qkv.tasks.lm import LanguageModel  # noqa: E402
from qkv.training.checkpoint import CheckpointError, load_config, save_checkpoint  # noqa: E402
from test_quant_kernels import quantization_bound  # noqa: E402

Q = gguf.GGMLQuantizationType
SRC = Path(__file__).resolve().parents[1] / "src"
# The float16 scale fields of each K type (byte offset -> largest magnitude drawn), small
# enough that a random block holds weights of a trained model's size.
K_SCALES = {"Q2_K": {80: 1e-3, 82: 1e-3}, "Q4_K": {0: 1e-4, 2: 1e-4},
            "Q5_K": {0: 1e-4, 2: 1e-4}, "Q6_K": {208: 2e-5}}


def blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of a random ``(rows, cols)`` weight: the legacy types quantized by gguf's
    own code, the K types (which its NumPy code cannot quantize) drawn at random with
    small scales."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SCALES:
        weight = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
        return gguf.quants.quantize(weight, Q[qtype])
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at, top in K_SCALES[qtype].items():
        raw[:, at:at + 2] = np.frombuffer(rng.uniform(-top, top, len(raw)).astype("<f2")
                                          .tobytes(), np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def readable(model: nn.Module) -> nn.Module:
    """``model`` with its quantized linear layers on the readable path (backend
    ``"torch"``: each weight expanded, then ``F.linear``)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.backend = "torch"
    return model


def test_quantized_types_are_gguf_s_sizes():
    assert list(quantized_types()) == list(KEPT_TYPES)
    assert quantized_types()["Q4_K"] == (256, 144) and quantized_types()["Q8_0"] == (32, 34)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_quantized_linear_and_embedding_against_gguf_s_dequantize(qtype):
    rows, cols = 12, 512
    data = blocks(qtype, rows, cols, seed=len(qtype))
    weight = gguf.quants.dequantize(data, Q[qtype]).astype(np.float64)  # (rows, cols)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, cols))
    bias = rng.standard_normal(rows)
    want = np.einsum("btc,rc->btr", x, weight) + bias  # float64, from the equation

    layer = QuantizedLinear(cols, rows, qtype, bias=True, blocks=torch.from_numpy(data))
    layer.backend = "torch"  # the readable path: the expanded weight, to rounding
    with torch.no_grad():
        layer.bias.copy_(torch.from_numpy(bias))
        got = layer(torch.from_numpy(x).float())
    assert got.shape == (3, 5, rows) and got.dtype == torch.float32
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.numpy(), want, atol=2e-6 * scale * np.sqrt(cols / 64))
    assert torch.equal(layer.weight, torch.from_numpy(weight).float())
    assert layer.blocks.shape == (rows, cols // quantized_types()[qtype][0]
                                  * quantized_types()[qtype][1])

    table = QuantizedEmbedding(rows, cols, qtype, blocks=torch.from_numpy(data))
    ids = torch.tensor([[3, 0, 11], [3, 7, 7]])
    assert torch.equal(table(ids), torch.from_numpy(weight[ids.numpy()]).float())
    assert table.bfloat16()(ids).dtype == torch.bfloat16  # .to(dtype) moves its dtype
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 12\), got 0..12"):
        table(torch.tensor([0, 12]))


@pytest.mark.skipif(decode_kernels() is None, reason=f"no native kernels: "
                    f"{unavailable_reason()}")
@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_native_backend_is_the_product_with_8_bit_activations(qtype):
    rows, cols = 40, 512
    data = blocks(qtype, rows, cols, seed=len(qtype) + 1)
    weight = gguf.quants.dequantize(data, Q[qtype]).astype(np.float64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, cols)).astype(np.float32)
    x[0, 0, :32] = 0.0  # a block of zeros, and one of outliers
    x[1, 3, 32:64] *= 50.0
    bias = rng.standard_normal(rows)
    want = np.einsum("btc,rc->btr", x.astype(np.float64), weight) + bias
    # each activation row quantized to 8 bits per block of 32 (tests/test_quant_kernels.py)
    bound = np.stack([quantization_bound(weight, row) for row in
                      x.reshape(-1, cols).astype(np.float64)]).reshape(want.shape)

    layer = QuantizedLinear(cols, rows, qtype, bias=True, blocks=torch.from_numpy(data))
    xs = torch.from_numpy(x)
    with torch.no_grad():
        layer.bias.copy_(torch.from_numpy(bias))
        out = {}
        for backend in ("native", "torch", "auto"):
            layer.backend = backend
            out[backend] = layer(xs)
        one = layer(xs[0, :1])  # "auto", one row (a prompt's last position in the head)
        half = layer(xs.bfloat16())
    error = np.abs(out["native"].numpy() - want)
    assert (error <= bound).all() and error.max() > 1e-3 * bound.max()
    assert (np.abs(out["native"].numpy() - out["torch"].numpy()) <= 2 * bound).all()
    assert torch.equal(out["auto"], out["native"])
    assert torch.equal(one, out["native"][0, :1])  # each row's sums in the same order
    assert half.dtype == torch.bfloat16 and half.shape == (2, 9, rows)
    # gradients: "auto" takes the readable path, "native" (which has no backward) says so
    xg = xs.clone().requires_grad_()
    assert torch.equal(layer(xg), out["torch"])
    layer.backend = "native"
    with pytest.raises(ValueError, match="^QuantizedLinear backend 'native' cannot run: it has "
                                         "no backward"):
        layer(xg)
    layer.backend = "fast"
    with pytest.raises(ValueError, match=r"^QuantizedLinear.backend must be one of \('auto', "):
        layer(xs)


def test_a_layer_refuses_blocks_of_another_shape_or_type():
    with pytest.raises(ValueError, match=r"QuantizedLinear: 4 rows of 256 Q4_K values need "
                                         r"uint8 blocks \(4, 144\), got torch.uint8 \(4, 145\)"):
        QuantizedLinear(256, 4, "Q4_K", blocks=torch.zeros(4, 145, dtype=torch.uint8))
    with pytest.raises(ValueError, match="type 'IQ4_NL' is not kept in blocks; kept: Q8_0"):
        QuantizedLinear(256, 4, "IQ4_NL")
    with pytest.raises(ValueError, match="100 values per row are not whole Q8_0 blocks of 32"):
        QuantizedLinear(100, 4, "Q8_0")


# Its tokens: single letters, which a byte-level BPE without merges reads one by one.
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(ord("A"), ord("V") + 1)]
# The tiny Llama: 256 wide (a K block), 2 layers, 4 query and 2 key/value heads.
D, F, V, LAYERS = 256, 512, 48, 2
# Every kept type, and one that is not (Q2_K, expanded at import).
PLAN = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K",
        "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K",
        "blk.0.attn_v.weight": "Q6_K", "blk.0.attn_output.weight": "Q8_0",
        "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_K",
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_1",
        "blk.1.attn_v.weight": "Q5_0", "blk.1.attn_output.weight": "Q5_1",
        "blk.1.ffn_gate.weight": "Q5_K", "blk.1.ffn_up.weight": "Q4_K",
        "blk.1.ffn_down.weight": "Q2_K"}


def tiny_llama(path: Path, plan: dict[str, str], tied: bool = False,
               expanded: bool = False, merges: bool = False) -> Path:
    """A Llama GGUF file of ``plan``'s types (norms F32), as llama.cpp's converter writes
    one; with ``tied``, no ``output.weight``; with ``expanded``, the same weights each
    dequantized to F32 (the float file the quantized one could have come from); with
    ``merges``, one BPE merge (llama.cpp reads no gpt2 tokenizer without merges)."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, D), "output.weight": (V, D)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (D, D), f"blk.{i}.attn_k.weight": (D // 2, D),
                       f"blk.{i}.attn_v.weight": (D // 2, D),
                       f"blk.{i}.attn_output.weight": (D, D),
                       f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                       f"blk.{i}.ffn_down.weight": (D, F)})
    if tied:
        del shapes["output.weight"]
    arrays = {name: (blocks(plan[name], *shape, seed=n), Q[plan[name]])
              for n, (name, shape) in enumerate(shapes.items())}
    if expanded:
        arrays = {name: gguf.quants.dequantize(*value).reshape(shapes[name])
                  for name, value in arrays.items()}
    norms = ["output_norm.weight"] + [f"blk.{i}.{k}_norm.weight" for i in range(LAYERS)
                                      for k in ("attn", "ffn")]
    for name in norms:
        arrays[name] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    meta = {"add_name": "Llama", "add_block_count": LAYERS, "add_embedding_length": D,
            "add_head_count": 4, "add_head_count_kv": 2, "add_context_length": 64,
            "add_feed_forward_length": F, "add_layer_norm_rms_eps": 1e-5,
            "add_rope_freq_base": 10000.0, "add_vocab_size": V,
            "add_rope_dimension_count": D // 4, "add_eos_token_id": 2,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": LETTERS}
    if merges:  # its last letter traded for the merge's token
        meta["tokenizer.ggml.tokens"] = LETTERS[:-1] + ["ab"]
        meta["tokenizer.ggml.merges"] = ["a b"]
    return write_gguf(path, arrays, "llama", meta)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    path = tiny_llama(root / "mixed.gguf", PLAN)
    tied = tiny_llama(root / "tied.gguf", {**PLAN, "token_embd.weight": "Q6_K"}, tied=True)
    out = {"file": path, "tied_file": tied}
    for name, source, extra in (("float", path, []), ("quantized", path, ["--keep-quantized"]),
                                ("tied", tied, ["--keep-quantized"])):
        out[name] = root / name
        assert main(["lm", "import", str(source), "--run-dir", str(out[name]), *extra]) == 0
    return out


IDS = torch.arange(20).mul(7).remainder(V).reshape(1, 20)


def test_keep_quantized_runs_as_the_float_import_does(runs, capsys):
    main(["lm", "import", str(runs["file"]), "--run-dir", str(runs["quantized"]),
          "--keep-quantized", "--overwrite"])
    out = capsys.readouterr().out
    assert "--keep-quantized: expanded to float32: Q2_K\n" in out
    assert "kept in their blocks: 15 layers (" in out
    ours, theirs = LanguageModel.load(runs["quantized"]), LanguageModel.load(runs["float"])
    kept = quantized_modules(ours.model)
    assert kept["tok_emb"] == "Q8_0" and kept["out_head"] == "Q6_K"
    assert kept["trf_blocks.1.att.W_key"] == "Q4_1" and "trf_blocks.1.ff.fc3" not in kept
    assert type(ours.model.trf_blocks[1].ff.fc3) is nn.Linear  # the Q2_K one, expanded
    assert quantized_modules(theirs.model) == {}
    # the run holds the blocks: no larger than the file, but for the Q2_K matrix it
    # expands to float32; far smaller than the float run
    size = (runs["quantized"] / "model.safetensors").stat().st_size
    assert size <= runs["file"].stat().st_size + D * F * 4
    assert size * 3 < (runs["float"] / "model.safetensors").stat().st_size
    with torch.no_grad():
        want = theirs.model(IDS)
        assert want.abs().max() > 0.1  # the weights carry signal
        # the readable path computes with the expanded weights: the float run's logits
        torch.testing.assert_close(readable(ours.model)(IDS), want, atol=1e-5, rtol=1e-5)
    for m in ours.model.modules():  # and generation with the default: prompts native
        if isinstance(m, QuantizedLinear):
            m.backend = "auto"
    tokens = generate(theirs.model, IDS[:, :5], 12, use_cache=False)
    for use_cache in (True, False):
        assert torch.equal(generate(ours.model, IDS[:, :5], 12, use_cache=use_cache), tokens)
    # generate's cached steps above ran on the native kernels, which read the blocks in
    # place (their 8-bit activations are checked in tests/test_quant_decode.py)
    assert native_unsupported(ours.model) is None


@pytest.mark.skipif(decode_kernels() is None, reason=f"no native kernels: "
                    f"{unavailable_reason()}")
def test_a_prompt_runs_on_the_native_matrix_products(runs, monkeypatch):
    # generate feeds the prompt through the module path (its steps through NativeDecoder):
    # every quantized linear layer takes the prompt's rows, or the head its last one, in
    # one native matrix product each
    model = LanguageModel.load(runs["quantized"]).model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    rows: dict[int, list[int]] = {}
    native = QuantizedLinear._native_forward

    def counted(self, x):
        rows.setdefault(id(self), []).append(x.numel() // self.in_features)
        return native(self, x)

    monkeypatch.setattr(QuantizedLinear, "_native_forward", counted)
    generate(model, IDS[:, :7], 5)
    assert rows == {id(m): [1 if m is model.out_head else 7] for m in layers}


def test_a_tied_head_shares_the_embedding_s_blocks_through_a_reload(runs):
    lm = LanguageModel.load(runs["tied"])
    head, emb = lm.model.out_head, lm.model.tok_emb
    assert isinstance(head, QuantizedLinear) and isinstance(emb, QuantizedEmbedding)
    assert head.blocks is emb.blocks and head.qtype == "Q6_K"
    weight = gguf.quants.dequantize(emb.blocks.numpy(), Q.Q6_K)
    x = torch.randn(2, D)
    head.backend = "torch"
    torch.testing.assert_close(head(x), x.double().matmul(torch.from_numpy(weight).double().T)
                               .float(), atol=1e-5, rtol=1e-5)
    # stored once: the run is smaller than the untied one by about the head's blocks
    assert load_config(runs["tied"])["settings"]["extra"]["quantized"]["out_head"] == "Q6_K"


def test_cli_paths_run_a_quantized_run(runs, tmp_path, capsys):
    run = str(runs["quantized"])
    for extra in ([], ["--no-kv-cache"]):
        assert main(["lm", "generate", "--ckpt", run, "--prompt", "abc", "--max-new-tokens",
                     "4", *extra]) == 0
    assert main(["lm", "attention", "--ckpt", run, "--prompt", "abcd",
                 "--heatmap", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0
    assert main(["view", "--ckpt", run, "--text", "abcd", "--generate", "2",
                 "--html", str(tmp_path / "a.html")]) == 0
    assert (tmp_path / "a.html").stat().st_size > 0
    text = tmp_path / "text.txt"
    text.write_text("abcdefghijklmnop" * 40)
    assert main(["lm", "train", "--init", run, "--text", str(text), "--run-dir",
                 str(tmp_path / "tuned"), "--epochs", "1", "--batch-size", "2",
                 "--context-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "its 15 quantized layers (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are " \
           "expanded to float32 to train\n" in out
    tuned = LanguageModel.load(tmp_path / "tuned")
    assert quantized_modules(tuned.model) == {}


def resaved(run: Path, target: Path, *, qtypes=None, state=None) -> Path:
    """``run``'s checkpoint saved again (a valid manifest) with its settings' quantized
    layers or its weights changed: what an edited or mismatched run looks like."""
    config = load_config(run)
    lm = LanguageModel.load(run)
    weights = dict(lm.model.state_dict()) if state is None else state(lm.model.state_dict())
    if qtypes is not None:
        config["settings"]["extra"]["quantized"] = qtypes(config["settings"]["extra"]
                                                          ["quantized"])
    save_checkpoint(target, weights, config)
    return target


def test_reload_refuses_a_mismatched_type_or_shape_in_one_line(runs, tmp_path):
    run = runs["quantized"]

    def refused(target: Path, *parts: str) -> None:
        with pytest.raises(CheckpointError) as error:
            LanguageModel.load(target)
        text = str(error.value)
        assert "\n" not in text and all(p in text for p in parts), text

    refused(resaved(run, tmp_path / "a", qtypes=lambda q: {**q, "trf_blocks.0.att.W_query":
                                                             "Q5_K"}),
            "trf_blocks.0.att.W_query.blocks is (256, 176), the weights say (256, 144)")
    refused(resaved(run, tmp_path / "b", qtypes=lambda q: {**q, "trf_blocks.0.att.W_query":
                                                             "IQ4_NL"}),
            "quantized layer 'trf_blocks.0.att.W_query': QuantizedLinear: type 'IQ4_NL' is "
            "not kept in blocks")
    refused(resaved(run, tmp_path / "c", qtypes=lambda q: {**q, "final_norm": "Q8_0"}),
            "quantized layer 'final_norm' is a RMSNorm; only Linear and Embedding")
    refused(resaved(run, tmp_path / "d", qtypes=lambda q: {k: v for k, v in q.items()
                                                           if k != "tok_emb"}),
            "the weights hold tok_emb.blocks, quantized blocks that config.json's "
            "settings.extra.quantized does not list")
    refused(resaved(run, tmp_path / "e", state=lambda s: {
        **s, "trf_blocks.0.att.W_query.blocks": s["trf_blocks.0.att.W_query.blocks"].char()}),
            "trf_blocks.0.att.W_query.blocks is stored as I8; the model is U8")
    refused(resaved(run, tmp_path / "f", qtypes=lambda q: [1, 2]),
            "settings.extra.quantized is a list of 2 item(s); expected module name -> GGML type")


def test_import_refuses_a_damaged_block_in_one_line(tmp_path, capsys):
    path = tiny_llama(tmp_path / "m.gguf", PLAN)
    data = bytearray(path.read_bytes())
    info = read_gguf_header(path).tensors["blk.0.attn_output.weight"]  # Q8_0
    data[info.offset + 34:info.offset + 36] = np.float16(np.nan).tobytes()  # block 2's scale
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    assert main(["lm", "import", str(bad), "--run-dir", str(tmp_path / "r"),
                 "--keep-quantized"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tensor blk.0.attn_output.weight has 1 block(s) of 2,048 " \
        "with a NaN or infinite scale; the weights are damaged" in err, err
    short = tmp_path / "short.gguf"
    short.write_bytes(bytes(data[:len(data) - 1000]))
    assert main(["lm", "import", str(short), "--run-dir", str(tmp_path / "s"),
                 "--keep-quantized"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ends past the file's end" in err, err


def test_train_init_of_a_float_model_builds_as_before():
    # (dequantize_modules is a no-op on a float model)
    from qkv.models.quantized import dequantize_modules
    model = GPTModel(GPTConfig(vocab_size=16, emb_dim=8, n_heads=2, n_layers=1,
                               context_length=8))
    assert dequantize_modules(model) == {}


# A fresh process's peak resident memory before and after a load, in bytes: exec gives
# it a new address space, whose high-water mark (VmHWM) counts none of pytest's pages.
MEASURE = """
import re, sys
import torch, qkv.tasks.lm
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
base = peak()
qkv.tasks.lm.LanguageModel.load(sys.argv[1])
print("torch._dynamo" in sys.modules, "sympy" in sys.modules, base, peak())
"""


def test_load_holds_the_weights_once(runs, tmp_path):
    """``LanguageModel.load`` of a 70 MB float32 run peaks at its weights above the
    interpreter (torch and qkv imported): the buffer the file is read into is the
    model's memory, not a state dict copied into a second, randomly initialised model;
    and the model built on the meta device imports neither torch._dynamo nor sympy
    (which a meta tensor's ``normal_`` would, ~70 MB)."""
    config = load_config(runs["float"])
    fields = {**config["model"], "emb_dim": 512, "n_heads": 8, "n_layers": 8,
              "hidden_dim": 1024}
    cfg = GPTConfig.from_dict(fields)
    assert not cfg.tie_weights
    state = {name: torch.full(t.shape, 0.01) for name, t in cfg.meta_model().state_dict().items()}
    weights = sum(t.numel() for t in state.values()) * 4
    assert weights > 64e6
    config["model"] = config["settings"]["architecture"] = cfg.to_dict()
    save_checkpoint(tmp_path / "run", state, config)
    del state
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "run")], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    dynamo, sympy, base, peak = out.stdout.split()[-4:]
    assert (dynamo, sympy) == ("False", "False"), out.stdout
    base, peak = int(base), int(peak)
    # (16 MiB: the run's config and tokenizer, whatever the model's size; the load of
    # a state dict copied into a built model peaked at 3x the weights)
    assert peak - base < 1.1 * weights + 16 * 2**20, (peak - base, weights)


def test_import_reads_the_tokenizer_without_a_gguf_reader(runs, tmp_path, monkeypatch):
    """The import reads the file's tokenizer lists with qkv's own header walk: a
    ``gguf.GGUFReader`` holds a NumPy view of every token and merge (150 MB for a 50k
    vocabulary); the imported tokenizer is the reader's."""
    import gguf

    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    expected = tokenizer_from_gguf(runs["file"])

    def refused(*args, **kwargs):
        raise AssertionError("the import opened a gguf.GGUFReader")

    monkeypatch.setattr(gguf, "GGUFReader", refused)
    assert main(["lm", "import", str(runs["file"]), "--run-dir", str(tmp_path / "run"),
                 "--keep-quantized"]) == 0
    tokenizer = LanguageModel.load(tmp_path / "run").tokenizer
    assert tokenizer.to_dict() == expected.to_dict()
    assert tokenizer.encode("".join(LETTERS[3:9])) == expected.encode("".join(LETTERS[3:9]))


def test_quality_against_a_float64_computation(runs, tmp_path, capsys):
    """``qkv bench quality``'s numbers are llama-perplexity's, computed here from the
    logits in float64: a quantized run against its float32 import is exactly 0 KL; a
    perturbed model against the float one is not, and matches the equations."""
    from qkv.bench.quality import next_token_quality

    ours, ref = LanguageModel.load(runs["quantized"]).model, LanguageModel.load(runs["float"]).model
    readable(ours)
    ids = torch.arange(48).mul(5).remainder(V)
    same = next_token_quality(ours, ref, ids, 16)
    assert same["positions"] == 3 * 7 and same["kl_max"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["ppl"] == same["ref_ppl"]

    torch.manual_seed(0)
    other = LanguageModel.load(runs["float"]).model
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    got = next_token_quality(other, ref, ids, 16)
    kl, nll, ref_nll, agree = [], [], [], []
    for c in range(3):
        chunk = ids[16 * c:16 * (c + 1)].reshape(1, 16)
        with torch.no_grad():
            q_logits = other(chunk)[0].double().numpy()
            p_logits = ref(chunk)[0].double().numpy()
        for t in range(8, 15):
            p = np.exp(p_logits[t] - p_logits[t].max())
            p /= p.sum()
            q = np.exp(q_logits[t] - q_logits[t].max())
            q /= q.sum()
            kl.append(float(np.sum(p * np.log(p / q))))
            nxt = int(chunk[0, t + 1])
            nll.append(-np.log(q[nxt]))
            ref_nll.append(-np.log(p[nxt]))
            agree.append(p.argmax() == q.argmax())
    assert got["positions"] == len(kl) and min(kl) > 0
    np.testing.assert_allclose(got["kl"], kl, rtol=1e-9, atol=1e-12)
    assert got["kl_mean"] == pytest.approx(np.mean(kl), rel=1e-9)
    assert got["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert got["ppl"] == pytest.approx(np.exp(np.mean(nll)), rel=1e-9)
    assert got["ref_ppl"] == pytest.approx(np.exp(np.mean(ref_nll)), rel=1e-9)
    assert got["top1_agreement"] == pytest.approx(np.mean(agree))

    text = tmp_path / "text.txt"
    text.write_text("".join(LETTERS[i % V] for i in range(0, 700, 7)))
    assert main(["bench", "quality", "--ckpt", str(runs["quantized"]), "--ref",
                 str(runs["float"]), "--text", str(text), "--tokens", "64", "--window", "32",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "quality.json").read_text())
    # the run computes its windows with the native matrix products where they run, which
    # quantize activations to 8 bits as llama.cpp's CPU products do: a KL of that order
    (one,) = report["runs"]
    assert one["positions"] == 2 * 15 and one["kl_max"] < 1e-4
    assert one["top1_agreement"] == 1.0
    assert "| positions |" in capsys.readouterr().out

    # several runs against one reference: each is the number it is alone (the
    # reference itself: exactly 0)
    assert main(["bench", "quality", "--ckpt", str(runs["quantized"]), str(runs["float"]),
                 "--ref", str(runs["float"]), "--text", str(text), "--tokens", "64",
                 "--window", "32", "--out", str(tmp_path / "two")]) == 0
    first, second = json.loads((tmp_path / "two" / "quality.json").read_text())["runs"]
    assert first["ckpt"] == str(runs["quantized"]) and first["kl"] == one["kl"]
    assert second["ckpt"] == str(runs["float"]) and second["kl_max"] == 0.0
    assert second["ppl"] == second["ref_ppl"] == one["ref_ppl"]
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("|")]
    assert [row[2].strip() for row in rows[2:]] == ["qkv", "qkv"]
    assert main(["bench", "quality", "--ckpt", str(runs["quantized"]), "--ref",
                 str(runs["float"]), "--text", str(text), "--out", str(tmp_path / "out")]) != 0
    assert "has 100 tokens; at least 4,096 are read" in capsys.readouterr().err


def test_quality_with_llama_cpp_needs_the_runs_source_files(runs, tmp_path, capsys):
    """``--llama-cpp`` reads the GGUF files the runs were imported from: a run whose file
    is gone is refused in one line naming it, before any logits are computed."""
    gone = tiny_llama(tmp_path / "gone.gguf", PLAN)
    assert main(["lm", "import", str(gone), "--run-dir", str(tmp_path / "run"),
                 "--keep-quantized"]) == 0
    gone.unlink()
    text = tmp_path / "text.txt"
    text.write_text("".join(LETTERS[i % V] for i in range(0, 700, 7)))
    capsys.readouterr()
    assert main(["bench", "quality", "--ckpt", str(tmp_path / "run"), "--ref",
                 str(runs["float"]), "--text", str(text), "--tokens", "64", "--window", "32",
                 "--llama-cpp", "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--ckpt {tmp_path / 'run'} was imported from {gone}" in err[0]
    assert not (tmp_path / "out" / "quality.json").exists()


def test_quality_beside_llama_cpp_on_the_same_files(runs, tmp_path, capsys):
    """With ``--llama-cpp``, llama.cpp's logits of the quantized file against those of
    the float file it expands to give the KL that qkv's give for the two runs: the
    weights are the same values, so both KLs come from the 8-bit rounding of the
    activations, the same arithmetic on both sides."""
    pytest.importorskip("llama_cpp")
    files = {"q": tiny_llama(tmp_path / "q.gguf", PLAN, merges=True),
             "f32": tiny_llama(tmp_path / "f32.gguf", PLAN, expanded=True, merges=True)}
    for name, source, extra in (("quantized", "q", ["--keep-quantized"]), ("float", "q", []),
                                ("f32", "f32", [])):
        assert main(["lm", "import", str(files[source]), "--run-dir", str(tmp_path / name),
                     *extra]) == 0
    text = tmp_path / "text.txt"
    text.write_text("".join(LETTERS[i % V] for i in range(0, 1400, 7)))
    assert main(["bench", "quality", "--ckpt", str(tmp_path / "quantized"),
                 str(tmp_path / "float"), "--ref", str(tmp_path / "f32"), "--text", str(text),
                 "--tokens", "192", "--window", "64", "--llama-cpp", "--out",
                 str(tmp_path / "out")]) == 0
    quantized, float_run = json.loads((tmp_path / "out" / "quality.json").read_text())["runs"]
    assert float_run["kl_max"] == 0.0  # the float import of either file: the same weights
    ours, theirs = quantized["kl_mean"], quantized["llama_cpp"]["kl_mean"]
    assert ours > 0 and theirs > 0
    assert 0.5 < ours / theirs < 2


def test_quality_checks_every_run_before_reading_weights(runs, tmp_path, capsys,
                                                         monkeypatch):
    """Every run's config is read and compared before any model is loaded: a folder that
    is no run, or a run of another vocabulary, is one line naming it, and no weights
    were read."""
    import dataclasses

    from qkv.tasks.lm import LanguageModel
    text = tmp_path / "text.txt"
    text.write_text("".join(LETTERS[i % V] for i in range(0, 700, 7)))
    loaded = []
    monkeypatch.setattr(LanguageModel, "load", lambda *a, **k: loaded.append(a))
    args = ["--ref", str(runs["float"]), "--text", str(text), "--tokens", "64", "--window",
            "32", "--out", str(tmp_path / "out")]
    capsys.readouterr()
    assert main(["bench", "quality", "--ckpt", str(runs["quantized"]), str(tmp_path),
                 *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path) in err[0] and not loaded

    read = LanguageModel.read_config

    def wider(run):  # the tied run as if its vocabulary were one id larger
        settings, config = read(run)
        if Path(run) == runs["tied"]:
            config = dataclasses.replace(config, vocab_size=config.vocab_size + 1)
        return settings, config
    monkeypatch.setattr(LanguageModel, "read_config", staticmethod(wider))
    assert main(["bench", "quality", "--ckpt", str(runs["quantized"]), str(runs["tied"]),
                 *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--ckpt {runs['tied']} {V + 1:,}" in err[0] and not loaded
    assert not (tmp_path / "out" / "quality.json").exists()


def test_bench_generate_times_a_quantized_run_on_its_blocks(runs, tmp_path):
    """``bench generate --ckpt`` on a quantized run times its blocks and their float32
    expansion (the same greedy tokens where the margins allow), with the ceiling from
    the bytes a step reads of the file: each tensor's bytes as the gguf package reads
    them (one row of the untied embedding; the tensor not kept, and the norms, as
    float32)."""
    from qkv.bench.generate_run import RunGenerateConfig, run_generate_run
    config = RunGenerateConfig(ckpt=str(runs["quantized"]), new_tokens=4, repeats=1,
                               prefill_tokens=16, contexts=(8,), sweep_tokens=2,
                               bandwidth_mib=4)
    report = run_generate_run(config, tmp_path / "out", log=lambda line: None)
    assert {"qkv blocks", "qkv float32"} <= set(report["results"])
    assert report["results"]["qkv blocks"]["dtype"] == "blocks"
    assert "llama.cpp" in report["skipped"] or any(n.startswith("llama.cpp ")
                                                   for n in report["results"])
    expected = 0
    for t in gguf.GGUFReader(runs["file"]).tensors:
        kept = t.tensor_type.name not in ("F32", "Q2_K")
        size = int(t.n_bytes) if kept else int(t.n_elements) * 4
        expected += size // V if t.name == "token_embd.weight" else size
    assert report["bytes_per_token"]["blocks"]["weights"] == expected
    assert report["kept_types"] == sorted(set(PLAN.values()) - {"Q2_K"})
    names = {t["name"] for t in report["targets"]}
    assert "qkv blocks >= 3x qkv float32" in names  # a Q4_K file's target


def test_bench_generate_skips_llama_cpp_on_a_changed_source_file(tmp_path):
    """The import records its file's SHA-256; llama.cpp is timed on that file only while
    it still holds those bytes (else the note says why it was left out)."""
    from qkv.bench.generate_run import RunGenerateConfig, _quantized_peers
    source = tiny_llama(tmp_path / "model.gguf", PLAN)
    assert main(["lm", "import", str(source), "--run-dir", str(tmp_path / "run"),
                 "--keep-quantized"]) == 0
    lm = LanguageModel.load(tmp_path / "run")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    assert lm.settings.extra["source_sha256"] == digest
    with open(source, "ab") as f:
        f.write(b"\0")
    paths, skipped = _quantized_peers(lm, RunGenerateConfig(ckpt=str(tmp_path / "run")))
    assert set(paths) == {"qkv blocks", "qkv float32"}
    assert skipped == {"llama.cpp": f"{source} has changed since the run was imported (its "
                                    "SHA-256 differs)"}
