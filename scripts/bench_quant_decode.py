"""Decode quantized GGUF files on qkv's block kernels and on llama.cpp, side by side.

    PYTHONPATH=src python scripts/bench_quant_decode.py make RUN SOURCE.gguf DIR
    PYTHONPATH=src python scripts/bench_quant_decode.py time RUN FILE.gguf [FILE.gguf ...]
    PYTHONPATH=src python scripts/bench_quant_decode.py memory qkv|llama.cpp RUN FILE.gguf

``RUN`` is the model imported as float32 (``qkv lm import SOURCE.gguf --run-dir RUN``).

- ``make`` writes RUN's weights as an F32 GGUF file (qkv's own writer, with SOURCE's
  tokenizer) into DIR and has llama.cpp's quantizer (``llama_model_quantize``) write it
  as Q8_0, Q4_0, Q4_K_M and Q6_K.
- ``time``, per file: qkv decodes with the file's blocks kept as they are (every
  quantized matrix of the file replaces its float layer in RUN's model: a layer holding
  the blocks, ``qtype`` and ``blocks``, which qkv.models.native_decode reads in place;
  the file's float tensors stay RUN's float32), and llama.cpp (llama-cpp-python) on the
  same file, with RUN's float32 model on qkv's kernels beside them. Greedy, batch 1,
  128 new tokens after a 13-token prompt, the threads torch has (``OMP_NUM_THREADS``),
  rounds in rotating order with the read bandwidth (a ``sum`` over 1 GiB) each round.
  Decode rate: ``(n - 1) / (time of the last token - time of the first)``. Ceiling: the
  bandwidth over the bytes a step reads (each matrix's blocks once, one row of an untied
  embedding, the float vectors, the KV cache at its average length). Prefill: one
  forward over 512 random ids (qkv: the model's forward, which expands each quantized
  matrix as it multiplies).
- ``memory``: one path in a process of its own: RSS with its libraries imported
  (torch, qkv, gguf, safetensors and tokenizers, or llama_cpp), then after loading and
  decoding 128 tokens, and the peak. qkv loads RUN in float32 and replaces its layers
  (the quantized run of issue 35's ``--keep-quantized`` would load the blocks
  directly), so its peak is the float32 load's; the RSS after decoding (freed heap
  given back with ``malloc_trim``) is the quantized model's.

The quantized layers are built here from the GGUF file directly, for llama-family files
(SmolLM2, Llama): ``qkv lm import --keep-quantized`` (another branch) makes them a run.
"""

from __future__ import annotations

import ctypes
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.bench.lm import decode_bytes_per_token, read_bandwidth
from qkv.bench.peers import llama_cpp_peer
from qkv.kernels import QUANT_TYPES
from qkv.models.gguf_model import write_gguf
from qkv.models.gguf_weights import read_gguf_header, unpermute_rope
from qkv.models.gpt import generate
from qkv.models.hf_open import from_qkv, hf_config
from qkv.tasks.lm import LanguageModel

PROMPT = "Once upon a time, in a small village by the sea,"
NEW_TOKENS = 128
PREFILL = 512
QUANTIZE = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
            "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Blocks(nn.Module):
    """A linear (or embedding) layer whose weight stays in the GGUF file's blocks:
    ``blocks`` uint8 ``(rows, row bytes)``, ``qtype``; its forward expands them."""

    def __init__(self, blocks: Tensor, qtype: str, rows: int, columns: int,
                 embedding: bool, bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.qtype, self.embedding = qtype, embedding
        if embedding:
            self.num_embeddings, self.embedding_dim = rows, columns
        else:
            self.out_features, self.in_features = rows, columns
            self.bias = bias

    @property
    def weight(self) -> Tensor:
        import gguf.quants
        kind = gguf.GGMLQuantizationType[self.qtype]
        return torch.from_numpy(gguf.quants.dequantize(self.blocks.numpy(), kind))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        return F.embedding(x, w) if self.embedding else F.linear(x, w, self.bias)


def quantized_model(run: str, path: str, check: bool = True) -> tuple[LanguageModel, dict]:
    """RUN's model with every quantized matrix of the llama-family file ``path`` kept in
    its blocks; returns it and the count of each type kept."""
    lm = LanguageModel.load(run)
    model = lm.model.float()
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    names = {"token_embd.weight": "tok_emb", "output.weight": "out_head"}
    for i in range(model.cfg.n_layers):
        for ours, theirs in (("att.W_query", "attn_q"), ("att.W_key", "attn_k"),
                             ("att.W_value", "attn_v"), ("att.out_proj", "attn_output"),
                             ("ff.fc1", "ffn_gate"), ("ff.fc2", "ffn_up"),
                             ("ff.fc3", "ffn_down")):
            names[f"blk.{i}.{theirs}.weight"] = f"trf_blocks.{i}.{ours}"
    att = model.trf_blocks[0].att
    kept: dict[str, int] = {}
    for theirs, ours in names.items():
        info = header.tensors.get(theirs)
        if info is None or info.type_name not in QUANT_TYPES:
            continue
        rows, columns = info.shape
        blocks = torch.from_numpy(np.array(data[info.offset:info.offset + info.nbytes]))
        blocks = blocks.view(rows, -1)
        if theirs.endswith(("attn_q.weight", "attn_k.weight")):
            heads = att.num_heads if "attn_q" in theirs else att.num_kv_groups
            blocks = unpermute_rope(blocks, heads).contiguous()
        old = model.get_submodule(ours)
        layer = Blocks(blocks, info.type_name, rows, columns, ours == "tok_emb",
                       None if ours == "tok_emb" else old.bias)
        if check:  # the blocks hold the run's weights, rows in the run's order (to
            # their quantization, for a file quantized from the run's F32 export)
            cosine = F.cosine_similarity(layer.weight.flatten(), old.weight.flatten(), dim=0)
            assert cosine > 0.98, (theirs, float(cosine))
        owner, _, leaf = ours.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, layer)
        if ours == "tok_emb" and model.cfg.tie_weights:
            model.out_head = Blocks(blocks, info.type_name, rows, columns, False)
        kept[info.type_name] = kept.get(info.type_name, 0) + 1
    lm.model = model
    return lm, kept


def step_bytes(model: nn.Module, kv_cache: float) -> float:
    """Bytes one step reads: each block matrix once (one row of an untied embedding),
    every float parameter, and the KV cache's average."""
    seen, total = set(), 0.0
    for m in model.modules():
        if isinstance(m, Blocks):
            if m.blocks.data_ptr() in seen:
                continue
            seen.add(m.blocks.data_ptr())
            tied = model.cfg.tie_weights
            total += m.blocks[0].nbytes if m.embedding and not tied else m.blocks.nbytes
    for p in model.parameters():
        total += p.numel() * p.element_size()
    return total + kv_cache


def qkv_generate(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    times: list[float] = []
    out = generate(model, torch.tensor([prompt]), n, native=True,
                   on_token=lambda _: times.append(time.perf_counter()))
    return out[0, len(prompt):].tolist(), times


def qkv_prefill(model: nn.Module, prompt: list[int]) -> None:
    with torch.no_grad():
        model(torch.tensor([prompt]), caches=model.new_caches(1, len(prompt)),
              logits_to_keep=1)


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def make(run: str, source: str, folder: str) -> None:
    import llama_cpp
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lm = LanguageModel.load(run)
    fields, model_type = lm.model.cfg.to_dict(), lm.settings.extra["model_type"]
    f32 = out / "model-F32.gguf"
    write_gguf(f32, hf_config(fields, model_type), from_qkv(lm.model.float().state_dict(),
                                                            fields), "F32", tokenizer=source)
    for name, ftype in QUANTIZE.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.nthread = torch.get_num_threads()
        target = out / f"model-{name}.gguf"
        start = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(),
                                            ctypes.byref(params))
        assert rc == 0, (name, rc)
        print(f"{target}: {target.stat().st_size / 1e6:.1f} MB "
              f"({time.perf_counter() - start:.1f} s)")


def time_files(run: str, files: list[str], rounds: int = 3) -> None:
    threads = torch.get_num_threads()
    reference = LanguageModel.load(run)
    reference.model = reference.model.float()
    prompt = reference.encode_prompt(PROMPT)[0].tolist()
    kv = decode_bytes_per_token(reference.model, len(prompt), NEW_TOKENS)
    long_prompt = torch.randint(0, reference.model.cfg.vocab_size, (PREFILL,),
                                generator=torch.Generator().manual_seed(0)).tolist()
    buffer = torch.ones(2**28)
    bandwidth_call = read_bandwidth(buffer, 3)
    report = {"threads": threads, "prompt_tokens": len(prompt), "new_tokens": NEW_TOKENS,
              "files": {}}
    for path in files:
        lm, kept = quantized_model(run, path)
        llama = llama_cpp_peer(path, "llama.cpp", PREFILL + 128, "F32")
        assert not isinstance(llama, str), llama
        paths = {
            "qkv blocks": (lambda p, n, m=lm.model: qkv_generate(m, p, n),
                           lambda p, m=lm.model: qkv_prefill(m, p)),
            "llama.cpp": (llama.generate, llama.prefill),
            "qkv float32": (lambda p, n: qkv_generate(reference.model, p, n),
                            lambda p: qkv_prefill(reference.model, p)),
        }
        for gen, _ in paths.values():
            gen(prompt, 8)
        rates: dict[str, list[float]] = {name: [] for name in paths}
        tokens: dict[str, list[int]] = {}
        bandwidth = []
        names = list(paths)
        for r in range(rounds):
            start = time.perf_counter()
            bandwidth_call()
            bandwidth.append(3 * buffer.nbytes / (time.perf_counter() - start))
            for name in names[r % len(names):] + names[:r % len(names)]:
                out, times = paths[name][0](prompt, NEW_TOKENS)
                rates[name].append(rate(times))
                tokens[name] = out
            print(f"{Path(path).name} round {r + 1}: " + ", ".join(
                f"{n} {rates[n][-1]:.1f}" for n in names), flush=True)
        prefill = {}
        for name, (_, pre) in paths.items():
            pre(long_prompt[:16])
            samples = []
            for _ in range(2):
                start = time.perf_counter()
                pre(long_prompt)
                samples.append(PREFILL / (time.perf_counter() - start))
            prefill[name] = max(samples)
        bw = statistics.median(bandwidth)
        per_token = {"qkv blocks": step_bytes(lm.model, kv["kv_cache"]),
                     "qkv float32": kv["total"]}
        per_token["llama.cpp"] = per_token["qkv blocks"]  # the same file, the same cache
        diff = next((i for i, (a, b) in enumerate(zip(tokens["qkv blocks"],
                                                       tokens["llama.cpp"], strict=True))
                     if a != b), None)
        entry = {"kept": kept, "size_bytes": Path(path).stat().st_size,
                 "bandwidth": bw, "bytes_per_token": per_token,
                 "first_token_difference_vs_llama_cpp": diff, "paths": {}}
        for name in names:
            median = statistics.median(rates[name])
            entry["paths"][name] = {
                "tokens_per_sec": median, "min": min(rates[name]), "max": max(rates[name]),
                "percent_of_ceiling": 100 * median * per_token[name] / bw,
                "prefill_tokens_per_sec": prefill[name]}
        report["files"][Path(path).name] = entry
        print(json.dumps(entry, indent=1), flush=True)
        llama.close()
        del lm
    del buffer
    print(json.dumps(report))


def memory(path_kind: str, run: str, path: str) -> None:
    if path_kind == "llama.cpp":
        import llama_cpp  # noqa: F401
    else:
        import gguf.quants  # noqa: F401
        import safetensors.torch  # noqa: F401
        import tokenizers  # noqa: F401
    base = rss()
    if path_kind == "qkv":
        lm, kept = quantized_model(run, path, check=False)
        # the float32 layers it replaced, given back to the system (glibc keeps freed
        # heap otherwise)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        prompt = lm.encode_prompt(PROMPT)[0].tolist()
        qkv_generate(lm.model, prompt, NEW_TOKENS)
        gc.collect()  # the prompt's forward expanded each matrix for its products
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    else:
        peer = llama_cpp_peer(path, "llama.cpp", PREFILL + 128, "F32")
        peer.generate(list(range(1, 14)), NEW_TOKENS)  # 13 ids, as the prompt's
    print(json.dumps({"path": path_kind, "file": Path(path).name,
                      "rss_libraries_mb": base / 1e6, "rss_after_mb": rss() / 1e6,
                      "added_after_mb": (rss() - base) / 1e6,
                      "added_peak_mb": (peak_rss() - base) / 1e6}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "make":
        make(*args)
    elif command == "time":
        time_files(args[0], args[1:])
    elif command == "memory":
        memory(*args)
    else:
        raise SystemExit(f"unknown command {command!r}: make, time or memory")
