"""``qkv bench gguf``: how long a GGUF file of each tensor type takes to import.

A published GGUF file stores its matrices in one of some thirty GGML types (``Q4_K``,
``Q5_0``, ``IQ4_XS``, ``MXFP4``, ...), usually mixed. qkv expands each tensor to float32
(or bfloat16) at import: its own PyTorch decoders for the common types, the gguf
package's NumPy decoders for the rest (:func:`qkv.models.gguf_weights.gguf_weight_types`).
This suite writes, for each type, a Llama of about 135M parameters whose matrices are all
of that type (768 wide, 15 layers, a 49,152-token vocabulary), and times:

- **read**: every tensor expanded to float32 from the mapped file
  (:func:`~qkv.models.gguf_weights.read_gguf_tensors`: the bytes copied, decoded, checked
  for NaN), median over ``repeats``;
- **gguf's decoder**: for the types qkv decodes itself, ``gguf.quants.dequantize`` of the
  same tensors from the same map, interleaved with the read, and the ratio of the two
  (above 1: qkv's decoder is the faster);
- **import**: the whole ``qkv lm import`` (:func:`~qkv.tasks.lm.import_model`: header
  checks, tokenizer, read, the run's checkpoint written and synced), once.

The blocks are random with finite scales (gguf's NumPy code quantizes only a few types,
and decoding costs the same whatever the values). Each file is deleted before the next
type's is written, so the disk holds one at a time.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checks import MAX_COUNT, check_int
from ..models.gguf_weights import gguf_weight_types as readable_types
from ..models.gguf_weights import import_gguf, read_gguf_header, read_gguf_tensors
from ..tasks.lm import import_model
from ..utils.figures import new_figure, save_figure
from .timing import (
    Stats,
    hbars,
    machine_info,
    markdown_table,
    round_robin,
    target_line,
    write_json,
)

__all__ = ["GGUFImportConfig", "run_gguf_import"]

TARGET_SECONDS = 10.0  # a 135M-parameter file of any type imports within this
# Distinct random blocks drawn per type; the tensors repeat them (the decoders' cost
# does not depend on the values, and drawing finite blocks costs a decode).
POOL_BLOCKS = 4096


@dataclass
class GGUFImportConfig:
    """A Llama of ``hidden`` x ``layers`` (``ffn`` wide MLPs, ``heads`` heads of 64, 4 KV
    heads, ``vocab`` tokens, tied) written once per type in ``types`` (empty: every
    type the installed gguf package lets qkv read)."""

    types: tuple[str, ...] = ()
    hidden: int = 768
    layers: int = 15
    ffn: int = 2048
    heads: int = 12
    vocab: int = 49_152
    repeats: int = 3
    warmup: int = 1

    @classmethod
    def quick(cls, **overrides: Any) -> GGUFImportConfig:
        return cls(**{"types": ("Q8_0", "Q5_0", "Q4_K", "IQ4_XS"), "hidden": 256,
                      "layers": 2, "ffn": 512, "heads": 4, "vocab": 512, "repeats": 2,
                      **overrides})

    def validate(self) -> None:
        known = readable_types()
        unknown = [t for t in self.types if t not in known]
        if unknown:
            raise ValueError(f"type {unknown[0]!r} is not read; choose from "
                             f"{', '.join(known)}")
        for name in ("hidden", "layers", "ffn", "heads", "vocab"):
            check_int(name, getattr(self, name), 1, 1 << 20)
        check_int("repeats", self.repeats, 1, MAX_COUNT)
        check_int("warmup", self.warmup, 0, MAX_COUNT)
        if self.hidden % 256 or self.ffn % 256:
            raise ValueError(f"hidden ({self.hidden}) and ffn ({self.ffn}) must be multiples "
                             "of 256: every type's blocks must fit a row")
        if self.hidden != 64 * self.heads or self.heads % 4:
            raise ValueError(f"heads ({self.heads}) must be hidden / 64 "
                             f"({self.hidden // 64}) and a multiple of the 4 KV heads")


def _shapes(config: GGUFImportConfig) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names -> PyTorch shapes ``(out, in)`` of the model."""
    h, f, kv = config.hidden, config.ffn, 4 * 64
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab, h),
                                          "output_norm.weight": (h,)}
    for i in range(config.layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (h, h),
            f"blk.{i}.attn_k.weight": (kv, h), f"blk.{i}.attn_v.weight": (kv, h),
            f"blk.{i}.attn_output.weight": (h, h), f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
            f"blk.{i}.ffn_down.weight": (h, f)})
    return shapes


def _block_pool(gguf: Any, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """``POOL_BLOCKS`` random blocks of ``qtype`` whose values are finite and of a
    trained model's size (a block decoding to values over 1 is drawn again)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    pool = rng.integers(0, 256, (POOL_BLOCKS, size), dtype=np.uint8)
    for _ in range(10_000):
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(pool, qtype)
        bad = ~(np.abs(values) <= 1).all(axis=1)  # NaN too
        if not bad.any():
            return pool
        pool[bad] = rng.integers(0, 256, (int(bad.sum()), size), dtype=np.uint8)
    raise RuntimeError(f"could not draw {qtype.name} blocks with values in [-1, 1]")


def _write_file(path: Path, config: GGUFImportConfig, type_name: str) -> int:
    """The model as a GGUF file, its matrices of ``type_name`` (norms F32, as llama.cpp
    writes them); returns the number of parameters."""
    gguf = import_gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    pool = None if block == 1 else _block_pool(gguf, qtype, rng)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(config.hidden)
    writer.add_feed_forward_length(config.ffn)
    writer.add_head_count(config.heads)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10_000.0)
    writer.add_rope_dimension_count(64)
    writer.add_vocab_size(config.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab)])
    writer.add_eos_token_id(0)
    params = 0
    for name, shape in _shapes(config).items():
        n = int(np.prod(shape))
        params += n
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
        elif pool is None:  # F32, F16, BF16, F64: values drawn directly
            values = (rng.standard_normal(shape, np.float32) * 0.02)
            data = gguf.quants.quantize(values, qtype) if type_name == "BF16" else \
                values.astype({"F32": np.float32, "F16": np.float16,
                               "F64": np.float64}[type_name])
            writer.add_tensor(name, data.view(np.uint8).reshape(shape[0], -1),
                              raw_dtype=qtype)
        else:
            blocks = pool[rng.integers(0, POOL_BLOCKS, n // block)]
            writer.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return params


def _gguf_decode_all(path: Path) -> Callable[[], object]:
    """A call that dequantizes every tensor of the file with ``gguf.quants.dequantize``
    (whole rows, as qkv hands them to it), for the types qkv decodes itself."""
    gguf = import_gguf()
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def decode() -> None:
        for info in header.tensors.values():
            qtype = gguf.GGMLQuantizationType[info.type_name]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows = data[info.offset:info.offset + info.nbytes].reshape(
                -1, info.shape[-1] // block * size)
            with np.errstate(all="ignore"):
                values = gguf.quants.dequantize(rows, qtype)
            # F32 comes back as a view of the read-only map: copied, as qkv copies it
            torch.from_numpy(values if values.flags.writeable else values.copy())

    return decode


def run_gguf_import(config: GGUFImportConfig, out_dir: str | Path,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write and import a file of each type; print the table, write ``gguf.json`` and
    ``gguf.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    work = out_dir / "gguf-bench-files"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    who = readable_types()
    types = config.types or tuple(who)
    machine = machine_info(torch.device("cpu"))
    log(f"gguf: a Llama {config.hidden} wide, {config.layers} layers, {config.vocab:,} "
        f"tokens, its matrices of each of {len(types)} types; read {config.repeats} times "
        f"(median), imported once; {machine['cpu']}, {machine['torch_threads']} threads")
    results: dict[str, Any] = {}
    rows = []
    try:
        for type_name in types:
            path = work / f"{type_name}.gguf"
            params = _write_file(path, config, type_name)
            header = read_gguf_header(path)
            cases: dict[str, Callable[[], object]] = {
                "read": lambda p=path, h=header: read_gguf_tensors(p, header=h)}
            if who[type_name] == "qkv" and type_name not in ("F32", "F64"):
                cases["gguf"] = _gguf_decode_all(path)
            stats = round_robin(cases, repeats=config.repeats, warmup=config.warmup,
                                device=torch.device("cpu"))
            run_dir = work / f"{type_name}-run"
            start = time.perf_counter()
            import_model(path, run_dir, log=lambda line: None)
            imported = time.perf_counter() - start
            read = stats["read"]
            entry: dict[str, Any] = {
                "decoder": who[type_name], "parameters": params,
                "file_bytes": path.stat().st_size, "read_seconds": read.to_dict(),
                "import_seconds": imported}
            ratio = ""
            if "gguf" in stats:
                entry["gguf_decode_seconds"] = stats["gguf"].to_dict()
                entry["speedup_over_gguf"] = stats["gguf"].median / read.median
                ratio = f"{entry['speedup_over_gguf']:.2f}x"
            results[type_name] = entry
            rows.append([type_name, who[type_name], f"{path.stat().st_size / 2**20:,.0f} MiB",
                         f"{read.median:.2f} s", f"{read.min:.2f}-{read.max:.2f} s",
                         f"{params / read.median / 1e6:,.0f} M/s", ratio,
                         f"{imported:.1f} s"])
            log(f"  {type_name}: read {read.median:.2f} s, import {imported:.1f} s")
            shutil.rmtree(run_dir, ignore_errors=True)
            path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(markdown_table(["type", "decoder", "file", "read (median)", "min-max",
                        "values/s", "gguf's decoder / qkv's read", "lm import"], rows))
    slowest = max(results, key=lambda t: results[t]["import_seconds"])
    worst = results[slowest]["import_seconds"]
    params = next(iter(results.values()))["parameters"]
    targets = [{
        "name": f"a {params / 1e6:.0f}M-parameter file of every type imports in under "
                f"{TARGET_SECONDS:g} s",
        "value": worst, "threshold": TARGET_SECONDS, "met": worst < TARGET_SECONDS,
        "value_text": f"slowest {slowest}: {worst:.1f} s"}]
    own = {t: r["speedup_over_gguf"] for t, r in results.items() if "speedup_over_gguf" in r}
    if own:
        least = min(own, key=own.get)
        targets.append({
            "name": "qkv's own decoders read at least as fast as gguf's",
            "value": own[least], "threshold": 1.0, "met": own[least] >= 1.0,
            "value_text": f"least {least}: {own[least]:.2f}x"})
    for target in targets:
        log(target_line(target))
    report: dict[str, Any] = {"suite": "gguf", "config": dataclasses.asdict(config),
                              "machine": machine, "results": results, "targets": targets}
    write_json(out_dir / "gguf.json", report)
    fig = new_figure(7, 1.2 + 0.28 * len(results))
    names = list(results)
    hbars(fig.add_subplot(), names, [Stats((r["import_seconds"],)).to_dict()
                                     for r in results.values()],
          colors=["tab:blue" if results[t]["decoder"] == "qkv" else "tab:orange"
                  for t in names],
          xlabel=f"seconds to import a {params / 1e6:.0f}M-parameter file (blue: qkv's "
                 "decoders, orange: gguf's)")
    save_figure(fig, out_dir / "gguf.png", dpi=100)
    return report
