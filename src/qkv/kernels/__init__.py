"""Native CPU kernels: C source shipped with qkv, compiled on first use, loaded with ctypes.

:func:`decode_kernels` returns the library built from ``decode.c`` and ``quant.c``
(one-token decoding of every model :mod:`qkv.models.gpt` builds: linear layers and gated
MLPs that read float32, bfloat16 or GGML block-quantized weights (:data:`QUANT_TYPES`)
in place, LayerNorm and RMSNorm, RoPE, grouped-query attention over a full or ring KV
cache with sinks, gates, partial RoPE and shared caches, latent and sparse latent
attention in the absorbed form, Gated DeltaNet, and mixtures of experts that read only
the chosen experts' rows; see the files), and the matrix products of a prompt's rows
with block-quantized weights (``qkv_quant_matmul``), or None when it cannot be had here;
:func:`unavailable_reason` then says why. It needs an x86-64 CPU with AVX2 and FMA (the
same check as PyTorch's own kernel dispatch), a C compiler with OpenMP (``$CC``, else
``cc``), and is switched off by ``QKV_NATIVE=0``. Nothing else in qkv needs it: every
caller has a PyTorch path that does the same maths
(:func:`qkv.models.gpt.generate`'s ``native`` switch).

Where PyTorch reports AVX-512, the library is built with ``-mavx512f`` too (its dot
products then read 64 bytes per instruction; :func:`flags`); ``QKV_NATIVE_AVX512=0``
builds the AVX2 one instead. Where the CPU also has AVX-512 VNNI (``avx512_vnni`` in
``/proc/cpuinfo``), the block products use its byte dot product (``QKV_NATIVE_VNNI=0``
leaves it out). On Intel CPUs the weight rows' loops prefetch in software
(``QKV_NATIVE_PREFETCH=0`` or ``1`` decides instead). The library is built once per
source version and flags
into ``$QKV_KERNEL_DIR`` (default ``~/.cache/qkv/kernels``), in about a second, and
reused by later processes. Its
OpenMP runtime is ``libgomp.so.1``, the name PyTorch's own is loaded under, so the
kernels and PyTorch share one pool of threads rather than two pools competing for the
cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["ACT_GELU", "ACT_SILU", "AVX512_FLAGS", "DeltaNet", "FLAGS", "GLU_CLAMPED", "GLU_GEGLU",
           "GLU_SWIGLU", "Latent", "Layer", "Mat", "Model", "Moe", "NORM_LAYER", "PREFETCH_FLAGS",
           "SCORE_SIGMOID", "SCORE_SOFTMAX", "NORM_NONE", "NORM_RMS", "Norm", "QUANT_TYPES",
           "VNNI_FLAGS",
           "decode_kernels", "flags", "quant_type_code", "unavailable_reason"]

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
# Added where the CPU has AVX-512 (PyTorch's capability "AVX512"): the dot products then
# read 64 bytes per instruction, half the loop of AVX2's for the same bytes.
AVX512_FLAGS = ("-mavx512f",)
# Added beside them where the CPU has VNNI: the block products' byte dot products take
# one instruction (vpdpbusd) instead of AVX2's two.
VNNI_FLAGS = ("-mavx512bw", "-mavx512vl", "-mavx512vnni")
# Added on Intel CPUs: the weight rows' loops ask for the lines 2 KiB ahead (decode.c
# says what this gained on a Xeon and cost on an AMD EPYC, where it is left out).
PREFETCH_FLAGS = ("-DQKV_PREFETCH=1",)

# GGML's block types the kernels compute on in place: name -> (type code in qkv_mat,
# values per block, bytes per block). Codes 0 and 1 are float32 and bfloat16; the build
# passes these to quant.c as -DQKV_<name>=<code>.
QUANT_TYPES = {"Q8_0": (2, 32, 34), "Q4_0": (3, 32, 18), "Q4_1": (4, 32, 20),
               "Q5_0": (5, 32, 22), "Q5_1": (6, 32, 24), "Q4_K": (7, 256, 144),
               "Q5_K": (8, 256, 176), "Q6_K": (9, 256, 210)}


def quant_type_code(qtype: str, columns: int) -> int:
    """The type code of a ``qtype`` matrix of ``columns`` values a row (one line if the
    type is not one of :data:`QUANT_TYPES` or a row is not whole blocks)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"the kernels do not read {qtype!r} blocks; they read "
                         f"{', '.join(QUANT_TYPES)}")
    code, values, _ = QUANT_TYPES[qtype]
    if columns % values:
        raise ValueError(f"a {qtype} row of {columns:,} values is not whole blocks of "
                         f"{values}")
    return code


def _cpuinfo(field: str) -> list[str]:
    """The words of the first ``field`` line of ``/proc/cpuinfo`` ([] where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.split()
    except OSError:
        pass
    return []


def _cpu_has(flag: str) -> bool:
    return flag in _cpuinfo("flags")


def _prefetch() -> bool:
    """Software prefetch in the weight rows' loops: ``QKV_NATIVE_PREFETCH=1`` or ``0``
    forces it on or off; by default on Intel CPUs only (where it was measured faster)."""
    setting = os.environ.get("QKV_NATIVE_PREFETCH", "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"QKV_NATIVE_PREFETCH must be auto, 0 or 1, got {setting!r}")
    if setting != "auto":
        return setting == "1"
    return _cpuinfo("vendor_id") == ["GenuineIntel"]


def flags() -> tuple[str, ...]:
    """The compiler flags for this CPU: :data:`FLAGS`, :data:`AVX512_FLAGS` where PyTorch
    reports AVX-512 and ``QKV_NATIVE_AVX512`` is not ``0``, :data:`VNNI_FLAGS` beside
    them where the CPU has AVX-512 VNNI and ``QKV_NATIVE_VNNI`` is not ``0``, and
    :data:`PREFETCH_FLAGS` where :func:`_prefetch` says so."""
    base = FLAGS + (PREFETCH_FLAGS if _prefetch() else ())
    wide = torch.backends.cpu.get_cpu_capability() == "AVX512" and \
        os.environ.get("QKV_NATIVE_AVX512", "1") != "0"
    if not wide:
        return base
    vnni = os.environ.get("QKV_NATIVE_VNNI", "1") != "0" and _cpu_has("avx512_vnni")
    return base + AVX512_FLAGS + (VNNI_FLAGS if vnni else ())


def _defines() -> tuple[str, ...]:
    return tuple(f"-DQKV_{name}={code}" for name, (code, _, _) in QUANT_TYPES.items())


_SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode.c", "quant.c"))
_HEADER = Path(__file__).with_name("quant.h")
_state: dict[str, object] = {}


def _kernel_dir() -> Path:
    env = os.environ.get("QKV_KERNEL_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qkv" / "kernels"


def _why_not_here() -> str | None:
    if os.environ.get("QKV_NATIVE", "1") == "0":
        return "switched off by QKV_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name != "posix":
        return f"the kernels are written for x86-64 Linux, not {platform.machine()} {os.name}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (PyTorch reports {capability})"
    return None


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes building at the same
    # time each write their own file, and a reader never sees half of one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags(), *_defines(), f"-I{_HEADER.parent}",
                               "-o", tmp, *map(str, _SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{compiler} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_P, _I, _N, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class Norm(ctypes.Structure):
    """``qkv_norm`` of decode.c: ``kind`` 0 (none), 1 (LayerNorm: ``scale``, ``shift``)
    or 2 (RMSNorm: ``scale``), float32 vectors, and ``eps``."""

    _fields_ = [("kind", _I), ("eps", _F), ("scale", _P), ("shift", _P)]


NORM_NONE, NORM_LAYER, NORM_RMS = 0, 1, 2


class Mat(ctypes.Structure):
    """``qkv_mat`` of quant.h: a weight matrix's address (``data``, row-major ``(rows,
    n)``) and its type code (0 float32, 1 bfloat16, or a :data:`QUANT_TYPES` code: each
    row then is its blocks, back to back); ``data`` None where there is none."""

    _fields_ = [("data", _P), ("type", _I)]
ACT_GELU, ACT_SILU = 0, 1
SCORE_SOFTMAX, SCORE_SIGMOID = 0, 1
GLU_SWIGLU, GLU_GEGLU, GLU_CLAMPED = 0, 1, 2


class Moe(ctypes.Structure):
    """``qkv_moe`` of decode.c: a mixture of experts' routing options, router, experts'
    3-D tensors (``gate_up (E, 2I, d)``, ``down (E, I, d)``), shared expert and its gate,
    Gemma 4's router scales, and its work buffers (``logits (E + 1)``, ``weights``,
    ``chosen`` int32 ``(top_k)``, ``hidden (top_k I + S)``, ``route (d)``, ``partial
    (threads, d)``)."""

    _fields_ = [*((name, _I) for name in ("experts", "top_k", "score", "norm_topk",
                                          "n_group", "topk_group", "glu")),
                ("width", _N), ("shared_width", _N),
                ("scaling", _F), ("alpha", _F), ("limit", _F),
                ("router", Mat), ("router_bias", _P), ("choice_bias", _P),
                ("gate_up", Mat), ("down", Mat), ("gate_up_bias", _P), ("down_bias", _P),
                ("shared1", Mat), ("shared2", Mat), ("shared3", Mat),
                ("shared_b1", _P), ("shared_b2", _P), ("shared_b3", _P),
                ("shared_gate", Mat),
                *((name, _P) for name in ("logits", "weights", "hidden", "chosen")),
                ("router_scale", _P), ("expert_scale", _P), ("router_eps", _F),
                ("route", _P), ("partial", _P)]


class Latent(ctypes.Structure):
    """``qkv_latent`` of decode.c: a multi-head latent attention layer (absorbed form),
    with DeepSeek sparse attention's indexer where ``index_heads`` is not 0, its latent
    cache (and index keys) and its work buffers."""

    _fields_ = [("heads", _I), ("interleave", _I), ("threads", _I),
                *((name, _N) for name in ("rank", "nope", "rope", "vdim", "q_rank")),
                ("scale", _F),
                *((name, Mat) for name in ("wq_a", "wq", "wkv_a", "wkv_b")),
                ("bq_a", _P), ("bkv_a", _P), ("q_norm", Norm), ("kv_norm", Norm),
                ("kv", _P),
                *((name, _N) for name in ("index_heads", "index_dim", "index_topk")),
                *((name, Mat) for name in ("iwq", "iwk", "iww")),
                ("ik_norm", Norm), ("index_keys", _P),
                *((name, _P) for name in ("cq", "q", "ql", "kvn", "oc", "part", "o", "iq",
                                          "ik", "iw", "iscore", "sel"))]


class DeltaNet(ctypes.Structure):
    """``qkv_deltanet`` of decode.c: a Gated DeltaNet layer's sizes, projections, float32
    taps, gates and norm weight, its cache (``window`` of the model's dtype, ``state``
    float32) and its work buffers."""

    _fields_ = [("k_heads", _I), ("v_heads", _I), ("kernel", _I), ("k_dim", _N),
                ("v_dim", _N), ("eps", _F),
                *((name, Mat) for name in ("wqkv", "wz", "wb", "wa", "wout")),
                *((name, _P) for name in ("taps", "a_log", "dt_bias", "norm", "window",
                                          "state", "m", "z", "b", "a", "o"))]


class Layer(ctypes.Structure):
    """``qkv_layer`` of decode.c: one block's parameters, norms, RoPE table and KV cache
    (addresses)."""

    _fields_ = [*((name, Mat) for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")),
                *((name, _P) for name in ("bq", "bk", "bv", "bo", "b1", "b2", "b3")),
                *((name, Norm) for name in ("norm1", "norm2", "post_norm1", "post_norm2",
                                            "q_norm", "k_norm")),
                ("rope_cos", _P), ("rope_sin", _P), ("keys", _P), ("values", _P),
                ("cache_len", _N), ("ring", _I),
                *((name, _N) for name in ("heads", "kv_heads", "head_dim")), ("scale", _F),
                ("sinks", _P), ("gated", _I),
                ("shared", _I), ("rotary_dim", _N), ("act", _I), ("hidden", _N),
                ("moe", ctypes.POINTER(Moe)), ("latent", ctypes.POINTER(Latent)),
                ("deltanet", ctypes.POINTER(DeltaNet)),
                ("values_from_keys", _I), ("v_norm", Norm), ("ple_gate", Mat),
                ("ple_proj", Mat), ("ple_norm", Norm), ("layer_scalar", _P),
                *((name, Norm) for name in ("post_dense_norm", "moe_norm", "post_moe_norm"))]


class Model(ctypes.Structure):
    """``qkv_model`` of decode.c: sizes, embeddings, head, layers and work buffers;
    ``dt`` is the caches' dtype code."""

    _fields_ = [("dt", _I), ("n_layers", _I), ("dim", _N), ("vocab", _N),
                ("embed_scale", _F),
                ("tok_emb", Mat), ("pos_emb", Mat), ("head", Mat), ("final_norm", Norm),
                ("layers", ctypes.POINTER(Layer)),
                *((name, _P) for name in ("x", "o", "h", "q", "g", "k", "v", "a", "f", "logits",
                                          "scores")),
                ("logit_softcap", _F), ("ple_embed", Mat), ("ple_proj", Mat),
                ("ple_norm", Norm), ("ple_width", _N), ("ple_vocab", _N),
                ("ple_embed_scale", _F), ("ple", _P), ("ple_row", _P), ("ple_g", _P),
                ("moe_x", _P), ("moe_y", _P)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i, n, f, m = _P, _I, _N, _F, ctypes.POINTER(Mat)
    lib.qkv_linear.argtypes = [m, p, p, p, n, n, i, i]
    lib.qkv_gated.argtypes = [m, p, m, p, p, p, n, n, i, i]
    lib.qkv_layer_norm.argtypes = [p, p, p, p, n, f]
    lib.qkv_rms_norm.argtypes = [p, p, p, n, f]
    lib.qkv_embed.argtypes = [m, n, m, n, f, p, n]
    lib.qkv_rope.argtypes = [p, p, p, n, n]
    lib.qkv_attend.argtypes = [p, p, p, p, p, i, p, n, n, n, n, n, n, f, p, i]
    lib.qkv_attend_cached.argtypes = [p, p, p, i, p, n, n, n, n, n, f, p, p, p, i]
    lib.qkv_route.argtypes = [ctypes.POINTER(Moe)]
    lib.qkv_moe_forward.argtypes = [ctypes.POINTER(Moe), p, p, n, i, i]
    lib.qkv_step.argtypes = [ctypes.POINTER(Model), n, n, i]
    lib.qkv_dequantize_row.argtypes = [m, n, n, p]
    lib.qkv_quant_dot_ref.argtypes = [m, n, n, p]
    lib.qkv_quant_dot_ref.restype = ctypes.c_double
    lib.qkv_quant_matmul.argtypes = [m, p, p, p, n, n, n, i]
    lib.qkv_quant_matmul.restype = ctypes.c_int
    for fn in (lib.qkv_linear, lib.qkv_gated, lib.qkv_layer_norm, lib.qkv_rms_norm,
               lib.qkv_embed, lib.qkv_rope, lib.qkv_attend, lib.qkv_attend_cached, lib.qkv_route,
               lib.qkv_moe_forward, lib.qkv_step, lib.qkv_dequantize_row):
        fn.restype = None


def decode_kernels() -> ctypes.CDLL | None:
    """The compiled ``decode.c`` (built on the first call of a new version), or None."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib, reason = None, _why_not_here()
    if reason is None:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            reason = "no C compiler (set CC, or install gcc)"
        else:
            # a new version of any source, or other flags or type codes, is a new build
            text = b"".join(path.read_bytes() for path in (*_SOURCES, _HEADER))
            key = hashlib.sha256(text + " ".join(flags() + _defines()).encode()).hexdigest()
            target = _kernel_dir() / f"decode-{key[:16]}.so"
            try:
                if not target.is_file():
                    _build(compiler, target)
                lib = ctypes.CDLL(str(target))
                _declare(lib)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                lib, reason = None, f"could not build or load {target.name}: {e}"
    _state["lib"], _state["reason"] = lib, reason
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`decode_kernels` returns None (None when it does not)."""
    decode_kernels()
    return _state["reason"]  # type: ignore[return-value]
