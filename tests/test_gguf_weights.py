"""qkv.models.gguf_weights: a GGUF file's header and tensors, read safely.

Tiny files are written with the gguf package's own GGUFWriter. Quantized blocks are
checked against the gguf package's dequantizer, against decoders written here one block
at a time from GGML's block layouts, and against the error bound of gguf's own
quantizer; the RoPE row order against llama.cpp's permutation and
transformers' GGUF loader.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import one_line, write_gguf  # noqa: E402
from qkv.models.gguf_weights import (  # noqa: E402
    QKV_DECODED_TYPES,
    gguf_version,
    gguf_weight_types,
    open_gguf_reader,
    quantization_mix,
    read_gguf_header,
    read_gguf_tensors,
    unpermute_rope,
)

Q = gguf.GGMLQuantizationType


LLAMA_META = {
    "llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": 64,
    "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0, "llama.rope.scaling.type": "linear",
    "llama.rope.scaling.factor": 2.0, "llama.vocab_size": 32,
    "tokenizer.ggml.tokens": ["a", "b", "c"],
}




@pytest.fixture
def small(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"token_embd.weight": rng.standard_normal((32, 64)).astype(np.float32),
              "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32),
              "blk.0.attn_q.weight": rng.standard_normal((64, 64)).astype(np.float16)}
    return write_gguf(tmp_path / "m.gguf", arrays, metadata=LLAMA_META), arrays


def test_header_config_and_shapes(small):
    path, arrays = small
    header = read_gguf_header(path)
    assert header.architecture == "llama" and header.version == 3
    config = header.config
    assert config["block_count"] == 2 and config["attention.head_count_kv"] == 2
    assert config["feed_forward_length"] == 96 and config["rope.scaling.type"] == "linear"
    assert config["attention.layer_norm_rms_epsilon"] == float(np.float32(1e-5))
    assert config["rope.scaling.factor"] == 2.0
    assert not any(k.startswith("tokenizer") for k in config)
    assert header.general["architecture"] == "llama"
    assert list(header.tensors) == list(arrays)
    for name, array in arrays.items():
        info = header.tensors[name]
        assert info.shape == array.shape  # PyTorch's (numpy's) order
        assert info.type_name == {np.float32: "F32", np.float16: "F16"}[array.dtype.type]
    # GGML lists dimensions fastest first: the reverse of ours.
    reader = gguf.GGUFReader(path)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert tuple(int(d) for d in embd.shape) == (64, 32)


def test_unquantized_round_trip_exact(tmp_path):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 32)) * 3).astype(np.float32)
    path = write_gguf(tmp_path / "f.gguf", {
        "f32": x, "f16": x.astype(np.float16),
        "bf16": (gguf.quants.quantize(x, Q.BF16), Q.BF16)})
    got = read_gguf_tensors(path)
    assert torch.equal(got["f32"], torch.from_numpy(x))
    assert torch.equal(got["f16"], torch.from_numpy(x.astype(np.float16).astype(np.float32)))
    assert torch.equal(got["bf16"], torch.from_numpy(x).to(torch.bfloat16).float())
    as_bf16 = read_gguf_tensors(path, ["bf16", "f32"], dtype=torch.bfloat16)
    assert list(as_bf16) == ["bf16", "f32"]
    assert as_bf16["bf16"].dtype == torch.bfloat16
    assert torch.equal(as_bf16["bf16"], torch.from_numpy(x).to(torch.bfloat16))


# ---------------------------------------------------------------------------
# Reference decoders, one block at a time, from GGML's block layouts.

def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, "<f2")[0])


def _scale_min_k4(j: int, s: bytes) -> tuple[int, int]:
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q8_0(b):
    d = _f16(b[:2])
    return [d * q for q in np.frombuffer(b[2:34], np.int8)]


def ref_q4_0(b):
    d, qs = _f16(b[:2]), b[2:18]
    return [((q & 0xF) - 8) * d for q in qs] + [((q >> 4) - 8) * d for q in qs]


def ref_q4_1(b):
    d, m, qs = _f16(b[:2]), _f16(b[2:4]), b[4:20]
    return [(q & 0xF) * d + m for q in qs] + [(q >> 4) * d + m for q in qs]


def _fifth(qh: bytes, j: int) -> int:
    return (int.from_bytes(qh, "little") >> j) & 1


def ref_q5_0(b):
    d, qh, qs = _f16(b[:2]), b[2:6], b[6:22]
    return ([(((q & 0xF) | _fifth(qh, j) << 4) - 16) * d for j, q in enumerate(qs)]
            + [(((q >> 4) | _fifth(qh, j + 16) << 4) - 16) * d for j, q in enumerate(qs)])


def ref_q5_1(b):
    d, m, qh, qs = _f16(b[:2]), _f16(b[2:4]), b[4:8], b[8:24]
    return ([((q & 0xF) | _fifth(qh, j) << 4) * d + m for j, q in enumerate(qs)]
            + [((q >> 4) | _fifth(qh, j + 16) << 4) * d + m for j, q in enumerate(qs)])


def ref_q2_k(b):
    scales, qs, d, dmin = b[:16], b[16:80], _f16(b[80:82]), _f16(b[82:84])
    out, i = [], 0
    for half in range(2):
        q = qs[32 * half:32 * half + 32]
        for shift in (0, 2, 4, 6):
            for part in (q[:16], q[16:]):
                sc = scales[i]
                i += 1
                out += [d * (sc & 0xF) * ((v >> shift) & 3) - dmin * (sc >> 4) for v in part]
    return out


def ref_q3_k(b):
    hmask, qs, packed, d = b[:32], b[32:96], b[96:108], _f16(b[108:110])
    # ggml's unpacking of the 16 six-bit scales, on three little-endian 32-bit words
    a0, a1, tmp = (int.from_bytes(packed[4 * i:4 * i + 4], "little") for i in range(3))
    k1, k2 = 0x03030303, 0x0F0F0F0F
    words = [(a0 & k2) | (((tmp >> 0) & k1) << 4), (a1 & k2) | (((tmp >> 2) & k1) << 4),
             ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
             ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.frombuffer(b"".join(w.to_bytes(4, "little") for w in words), np.int8)
    out, i, m = [], 0, 1
    for half in range(2):
        q = qs[32 * half:32 * half + 32]
        for shift in (0, 2, 4, 6):
            for lo in (0, 16):
                dl = d * (int(scales[i]) - 32)
                i += 1
                out += [dl * (((q[lo + k] >> shift) & 3) - (0 if hmask[lo + k] & m else 4))
                        for k in range(16)]
            m <<= 1
    return out


def ref_q4_k(b):
    d, dmin, scales, qs = _f16(b[:2]), _f16(b[2:4]), b[4:16], b[16:144]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sc, m = _scale_min_k4(2 * chunk + half, scales)
            out += [d * sc * ((v >> shift) & 0xF) - dmin * m for v in q]
    return out


def ref_q5_k(b):
    d, dmin, scales, qh, qs = _f16(b[:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sc, m = _scale_min_k4(2 * chunk + half, scales)
            bit = 2 * chunk + half
            out += [d * sc * (((v >> shift) & 0xF) + 16 * ((h >> bit) & 1)) - dmin * m
                    for v, h in zip(q, qh, strict=True)]
    return out


def ref_q6_k(b):
    ql, qh, sc, d = b[:128], b[128:192], np.frombuffer(b[192:208], np.int8), _f16(b[208:210])
    out = [0.0] * 256
    for n in range(2):
        lo, hi, s = ql[64 * n:64 * n + 64], qh[32 * n:32 * n + 32], sc[8 * n:8 * n + 8]
        for i in range(32):
            quads = (((lo[i] & 0xF) | ((hi[i] & 3) << 4)) - 32,
                     ((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32,
                     ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32,
                     ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32)
            for k, q in enumerate(quads):
                out[128 * n + 32 * k + i] = d * s[i // 16 + 2 * k] * q
    return out


# type -> (reference decoder, byte offsets of its float16 scales in a block)
REFERENCES = {
    Q.Q8_0: (ref_q8_0, (0,)), Q.Q4_0: (ref_q4_0, (0,)), Q.Q4_1: (ref_q4_1, (0, 2)),
    Q.Q5_0: (ref_q5_0, (0,)), Q.Q5_1: (ref_q5_1, (0, 2)), Q.Q2_K: (ref_q2_k, (80, 82)),
    Q.Q3_K: (ref_q3_k, (108,)), Q.Q4_K: (ref_q4_k, (0, 2)), Q.Q5_K: (ref_q5_k, (0, 2)),
    Q.Q6_K: (ref_q6_k, (208,)),
}


def test_every_quantized_qkv_type_has_a_reference_here():
    quantized = {t for t in QKV_DECODED_TYPES if not t.startswith(("F", "BF"))}
    assert quantized == {t.name for t in REFERENCES}


def test_quantized_blocks_match_reference_decoders(tmp_path):
    rng = np.random.default_rng(2)
    tensors, expected = {}, {}
    for qtype, (decode, scale_at) in REFERENCES.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, blocks_per_row = 3, 2
        raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
        for at in scale_at:  # finite scales (random bytes may spell NaN)
            raw[:, at:at + 2] = np.frombuffer(
                rng.uniform(-0.5, 0.5, len(raw)).astype("<f2").tobytes(), np.uint8
            ).reshape(-1, 2)
        name = f"w_{qtype.name}"
        tensors[name] = (raw.reshape(rows, blocks_per_row * size), qtype)
        values = [decode(bytes(b)) for b in raw]
        expected[name] = torch.tensor(values, dtype=torch.float64).reshape(
            rows, blocks_per_row * block)
    path = write_gguf(tmp_path / "q.gguf", tensors)
    header = read_gguf_header(path)
    got = read_gguf_tensors(path)
    for name, want in expected.items():
        assert header.tensors[name].shape == tuple(want.shape)
        assert got[name].dtype == torch.float32 and got[name].shape == want.shape
        torch.testing.assert_close(got[name].double(), want, rtol=1e-6, atol=1e-6)
    bf = read_gguf_tensors(path, ["w_Q6_K"], dtype=torch.bfloat16)["w_Q6_K"]
    assert torch.equal(bf, got["w_Q6_K"].to(torch.bfloat16))


def test_quantized_equal_gguf_dequantize(tmp_path):
    """Many random blocks of each type, 3-D too: bit for bit what gguf's numpy
    dequantizer gives (the same float32 operations in the same order)."""
    rng = np.random.default_rng(6)
    tensors = {}
    for qtype, (_, scale_at) in REFERENCES.items():
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, (2 * 3 * 4, size), dtype=np.uint8)
        for at in scale_at:
            raw[:, at:at + 2] = np.frombuffer(
                rng.uniform(-2, 2, len(raw)).astype("<f2").tobytes(), np.uint8).reshape(-1, 2)
        tensors[qtype.name] = (raw.reshape(2, 3, 4 * size), qtype)
    path = write_gguf(tmp_path / "q.gguf", tensors)
    got = read_gguf_tensors(path)
    for name, (raw, qtype) in tensors.items():
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        assert got[name].shape == want.shape
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_error_within_format_bound(tmp_path, qtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", {"w": (gguf.quants.quantize(x, qtype), qtype)})
    got = read_gguf_tensors(path)["w"].numpy()
    blocks, err = x.reshape(-1, 32), np.abs(got - x).reshape(-1, 32)
    amax = np.abs(blocks).max(1)
    # One quantization step: Q8_0 amax/127 (error half a step); Q4_0 amax/8 (the
    # extreme value may be clipped a whole step); Q4_1 (max-min)/15 (half a step). Plus
    # the float16 rounding of the scale, relative 2**-11 of each value.
    step = {Q.Q8_0: amax / 127 / 2, Q.Q4_0: amax / 8,
            Q.Q4_1: (blocks.max(1) - blocks.min(1)) / 15 / 2}[qtype]
    bound = step + amax * 2.0**-10 + 1e-7
    assert (err <= bound[:, None]).all()
    assert err.max() > 0  # it really was quantized


# ---------------------------------------------------------------------------
# RoPE row order

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's permutation of q/k rows (LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_rope_inverts_llama_cpp_and_matches_transformers():
    processor = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    rng = np.random.default_rng(4)
    for n_heads, shape in ((4, (32, 24)), (2, (16, 24)), (3, (18,))):
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w)
        back = unpermute_rope(torch.from_numpy(permuted), n_heads)
        assert torch.equal(back, torch.from_numpy(w))
        theirs = processor.LlamaTensorProcessor()._reverse_permute_weights(
            permuted, n_heads, n_heads)
        assert torch.equal(back, torch.from_numpy(np.ascontiguousarray(theirs)))
    with pytest.raises(ValueError) as error:
        unpermute_rope(torch.zeros(10, 4), 4)
    one_line(error, "10 rows", "4 heads")


def test_tiny_llama_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    arrays, ours = {}, {}
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        array = tensor.numpy()
        kind = hf_name.split(".")[-2]
        if kind in heads:
            array = llama_cpp_permute(array, heads[kind])
        arrays[name], ours[name] = np.ascontiguousarray(array), hf_name
    meta = {"llama.block_count": config.num_hidden_layers,
            "llama.attention.head_count": config.num_attention_heads,
            "llama.attention.head_count_kv": config.num_key_value_heads}
    path = write_gguf(tmp_path / "llama.gguf", arrays, metadata=meta)
    header = read_gguf_header(path)
    got = read_gguf_tensors(path, header=header)
    assert set(got) == set(ours) and "blk.1.attn_k.weight" in got
    for name, tensor in got.items():
        kind = ours[name].split(".")[-2]
        if kind == "q_proj":
            tensor = unpermute_rope(tensor, header.config["attention.head_count"])
        elif kind == "k_proj":
            tensor = unpermute_rope(tensor, header.config["attention.head_count_kv"])
        assert torch.equal(tensor, state[ours[name]]), name


# ---------------------------------------------------------------------------
# Refusals: one line each, before anything large is allocated.

def _tensor_info_at(data: bytes, name: str) -> int:
    """Offset of a tensor's dimension count in the header (just after its name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def test_refuses_non_files_and_non_gguf(tmp_path):
    with pytest.raises(OSError) as error:
        read_gguf_header(tmp_path)
    one_line(error, "directory")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as error:
        read_gguf_header(fifo)
    one_line(error, "FIFO")
    with pytest.raises(FileNotFoundError):
        read_gguf_tensors(tmp_path / "absent.gguf")
    text = tmp_path / "model.safetensors"
    text.write_bytes(b'{"not": "gguf"}' + bytes(100))
    with pytest.raises(ValueError) as error:
        read_gguf_header(text)
    one_line(error, str(text), "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError) as error:
        read_gguf_header(empty)
    one_line(error, "empty")


def test_refuses_bad_version_and_truncation(small, tmp_path):
    path, _ = small
    data = path.read_bytes()
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(data[:4] + struct.pack("<I", 9) + data[8:])
    with pytest.raises(ValueError) as error:
        read_gguf_header(bad)
    one_line(error, str(bad), "version 9", "supported: 2, 3")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(cut)
    one_line(error, str(cut), "blk.0.attn_q.weight", "past the file's end")
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:60])
    with pytest.raises(ValueError) as error:
        read_gguf_header(short)
    one_line(error, str(short), "truncated GGUF header")


def test_refuses_lying_headers(small, tmp_path):
    path, _ = small
    data = bytearray(path.read_bytes())

    def edited(label, at, fmt, value):
        out = bytearray(data)
        struct.pack_into(fmt, out, at, value)
        target = tmp_path / f"{label}.gguf"
        target.write_bytes(bytes(out))
        return target

    q = _tensor_info_at(data, "blk.0.attn_q.weight")  # n_dims u32, 2 dims u64, type, offset
    norm = _tensor_info_at(data, "blk.0.attn_norm.weight")  # 1 dim
    cases = [
        # The query weight moved onto the embedding's bytes.
        (edited("overlap", q + 4 + 16 + 4, "<Q", 0), "overlap"),
        (edited("misaligned", q + 4 + 16 + 4, "<Q", 8), "not a multiple"),
        (edited("huge_dim", q + 4, "<Q", 2**62), "dimensions"),
        (edited("big_dim", norm + 4, "<Q", 2**20), "past the file's end"),
        (edited("dims", q, "<I", 7), "7 dimensions"),
        (edited("type", norm + 4 + 8, "<I", 99), "type code 99, unknown to gguf"),
        (edited("tensors", 8, "<Q", 2**40), "tensor count"),
        (edited("keys", 16, "<Q", 2**62), "metadata count"),
    ]
    tokens = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens")
    cases.append((edited("array", tokens + 4 + 4, "<Q", 2**60), "at most"))
    for target, words in cases:
        with pytest.raises(ValueError) as error:
            read_gguf_header(target)
        one_line(error, str(target), words)


def test_refuses_unreadable_type_nan_and_budget(tmp_path):
    rng = np.random.default_rng(5)
    q8k = rng.integers(0, 256, (2, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), dtype=np.uint8)
    bad = np.ones((2, 32), np.float32)
    bad[1, 3], bad[0, 0] = np.nan, -np.inf
    path = write_gguf(tmp_path / "t.gguf", {"q8k": (q8k, Q.Q8_K), "nan": bad,
                                           "i32": np.arange(8, dtype=np.int32),
                                           "ok": np.ones((4, 32), np.float32)})
    assert read_gguf_header(path).tensors["q8k"].type_name == "Q8_K"
    # Q8_K is llama.cpp's intermediate type, which gguf has no dequantizer for.
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["q8k"])
    one_line(error, "tensor q8k is Q8_K", f"gguf {gguf_version()} cannot dequantize",
             "pip install -U gguf", "readable: F32, F16, Q4_0")
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["ok", "i32"])
    one_line(error, "tensor i32 is I32, integer data, not a weight type")
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["nan"])
    one_line(error, "tensor nan holds 2 NaN or infinite value(s) of 64")
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["missing"])
    one_line(error, "'missing'")
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["ok"], max_bytes=511)
    one_line(error, "512 bytes", "511")
    assert read_gguf_tensors(path, ["ok"], max_bytes=512)["ok"].shape == (4, 32)
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, ["ok"], dtype=torch.float16)
    one_line(error, "float32 or torch.bfloat16")


# ---------------------------------------------------------------------------
# Every type the gguf package dequantizes

def _quantizable(qtype) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        return False
    return True


QUANTIZABLE = [t for t in Q if _quantizable(t)]


def test_readable_types_are_every_type_gguf_dequantizes():
    """qkv reads every type the gguf package's dequantize reads, its own PyTorch
    decoders serving the common ones, and F64 besides."""
    def dequantizes(qtype) -> bool:
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        try:
            with np.errstate(all="ignore"):
                gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
        except NotImplementedError:
            return False
        return True

    types = gguf_weight_types()
    assert set(types) == {t.name for t in Q if dequantizes(t)} | {"F64"}
    assert {t for t, who in types.items() if who == "qkv"} == set(QKV_DECODED_TYPES)
    # the types a Q4_K_M file of a model 640 or 1,152 wide falls back to, and the
    # published low-bit and FP4 ones
    for name in ("Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ3_S",
                 "IQ2_XXS", "TQ1_0", "TQ2_0", "MXFP4"):
        assert name in types, name


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_reads_as_gguf_dequantizes(tmp_path, qtype):
    """A tensor quantized by the gguf package, written into a file, reads back bit for bit
    as gguf's dequantize gives it (as float32 and as bfloat16), and near the original."""
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((3, 2, 512)) * 0.5).astype(np.float32)
    data = gguf.quants.quantize(x, qtype)
    path = write_gguf(tmp_path / "q.gguf", {"w": (data, qtype) if data.dtype == np.uint8
                                            else data})
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), np.float32))
    got = read_gguf_tensors(path)["w"]
    assert got.shape == (3, 2, 512) and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(read_gguf_tensors(path, dtype=torch.bfloat16)["w"],
                       want.to(torch.bfloat16))
    # it was really quantized (or stored): within the coarsest format's step of x
    assert (got - torch.from_numpy(x)).abs().max() < 1.0


def _random_blocks(qtype, rows: int, row_blocks: int, seed: int) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``row_blocks`` blocks, every block redrawn until
    its values are finite: the scale fields, wherever the type keeps them, then hold
    real numbers (a random float16 is NaN or infinite one time in 32)."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (rows * row_blocks, size), dtype=np.uint8)
    for _ in range(100):
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(blocks, qtype)
        bad = ~np.isfinite(values).all(axis=1)
        if not bad.any():
            return blocks.reshape(rows, row_blocks * size)
        blocks[bad] = rng.integers(0, 256, (int(bad.sum()), size), dtype=np.uint8)
    raise AssertionError(f"no finite {qtype.name} blocks drawn")


@pytest.mark.parametrize("name", [t for t in gguf_weight_types()
                                  if not _quantizable(Q[t]) and t != "F64"])
def test_random_blocks_read_as_gguf_dequantizes(tmp_path, name):
    """The types gguf cannot quantize: random blocks with finite scales, 3-D, read back
    bit for bit as gguf's dequantize gives them."""
    qtype = Q[name]
    raw = _random_blocks(qtype, 6, 3, int(qtype))
    path = write_gguf(tmp_path / "r.gguf", {"w": (raw.reshape(2, 3, -1), qtype)})
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    with np.errstate(all="ignore"):
        want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(2, 3, -1), qtype))
    got = read_gguf_tensors(path)["w"]
    assert got.shape == (2, 3, 3 * block) == want.shape
    assert torch.equal(got, want)


def test_f64_rounds_once(tmp_path):
    x = np.random.default_rng(9).standard_normal((4, 8)) * 1e3
    path = write_gguf(tmp_path / "d.gguf", {"w": (x.view(np.uint8).reshape(4, 64), Q.F64)})
    assert torch.equal(read_gguf_tensors(path)["w"], torch.from_numpy(x).float())
    assert torch.equal(read_gguf_tensors(path, dtype=torch.bfloat16)["w"],
                       torch.from_numpy(x).to(torch.bfloat16))


def test_quantization_mix_counts_every_tensor(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", {
        "a": (gguf.quants.quantize(x, Q.Q5_0), Q.Q5_0), "b": x, "c": x,
        "d": (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0), "e": (gguf.quants.quantize(x, Q.Q5_0),
                                                            Q.Q5_0), "f": x})
    assert quantization_mix(read_gguf_header(path)) == "F32 x 3, Q5_0 x 2, Q8_0 x 1"


def test_open_gguf_reader_gives_the_tokenizer_metadata(small):
    path, arrays = small
    header, reader = open_gguf_reader(path)
    assert header.architecture == "llama"
    assert reader.get_field("tokenizer.ggml.tokens").contents() == ["a", "b", "c"]
    # The header read once serves the tensors; a file changed since is refused.
    got = read_gguf_tensors(path, ["token_embd.weight"], header=header)
    assert torch.equal(got["token_embd.weight"], torch.from_numpy(arrays["token_embd.weight"]))
    with open(path, "ab") as f:
        f.write(bytes(32))
    with pytest.raises(ValueError) as error:
        read_gguf_tensors(path, header=header)
    one_line(error, "changed since its header was read")
