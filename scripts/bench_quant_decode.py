"""Make llama.cpp-quantized GGUF files of a run, and measure the memory each path adds.

    PYTHONPATH=src python scripts/bench_quant_decode.py make RUN SOURCE.gguf DIR
    PYTHONPATH=src python scripts/bench_quant_decode.py memory qkv RUN
    PYTHONPATH=src python scripts/bench_quant_decode.py memory llama.cpp FILE.gguf

The timing itself is ``qkv bench generate --ckpt RUN`` on a run imported with
``qkv lm import FILE.gguf --keep-quantized``: qkv on the blocks, their float32
expansion and llama.cpp on the same file, in one process. This script does what that
cannot:

- ``make`` writes ``RUN`` (the model imported as float32) as an F32 GGUF file (qkv's own
  writer, with SOURCE's tokenizer) into DIR and has llama.cpp's quantizer
  (``llama_model_quantize``) write it as Q8_0, Q4_0, Q4_K_M and Q6_K;
- ``memory`` runs one path in a process of its own (a peak RSS is a process's): the RSS
  with its libraries imported (torch, qkv, gguf, safetensors and tokenizers, or
  llama_cpp), then the peak and the RSS after loading and after greedily decoding 128
  tokens after a 13-token prompt. qkv: ``LanguageModel.load(RUN)`` (a quantized run
  holds its blocks) and :func:`qkv.models.gpt.generate`; llama.cpp: ``Llama`` on the
  file with a float32 KV cache. "Added" is each minus the RSS with the libraries alone.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

PROMPT = "Once upon a time, in a small village by the sea,"
NEW_TOKENS = 128
QUANTIZE = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
            "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def status() -> dict[str, int]:
    """This process's resident memory now (``VmRSS``) and at its peak (``VmHWM``), bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def make(run: str, source: str, folder: str) -> None:
    from qkv.models.gguf_model import write_gguf
    from qkv.models.hf_open import from_qkv, hf_config
    from qkv.tasks.lm import LanguageModel

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lm = LanguageModel.load(run)
    fields, model_type = lm.model.cfg.to_dict(), lm.settings.extra["model_type"]
    f32 = out / "model-F32.gguf"
    write_gguf(f32, hf_config(fields, model_type), from_qkv(lm.model.float().state_dict(),
                                                            fields), "F32", tokenizer=source)
    quantize_files(f32, out, QUANTIZE)


def quantize_files(f32: Path, out: Path, types: dict[str, str]) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``, torch's thread count) writes the
    F32 GGUF file ``f32`` as ``out/model-NAME.gguf`` for each ``NAME: llama_cpp ftype``
    of ``types``, skipping the files already there."""
    import llama_cpp
    import torch

    for name, ftype in types.items():
        target = out / f"model-{name}.gguf"
        if target.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.nthread = torch.get_num_threads()
        start = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise SystemExit(f"{target}: llama_model_quantize returned {rc}")
        print(f"{target}: {target.stat().st_size / 1e6:.1f} MB "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


def memory(path_kind: str, target: str) -> None:
    if path_kind == "llama.cpp":
        import llama_cpp  # noqa: F401
        import torch  # the peer takes torch's thread count

        from qkv.bench.peers import llama_cpp_peer
    elif path_kind == "qkv":
        import gguf.quants  # noqa: F401
        import safetensors.torch  # noqa: F401
        import tokenizers  # noqa: F401
        import torch

        from qkv.models.gpt import generate
        from qkv.tasks.lm import LanguageModel
    else:
        raise SystemExit(f"memory: path {path_kind!r} is not qkv or llama.cpp")
    base = status()["VmRSS"]
    if path_kind == "qkv":
        lm = LanguageModel.load(target)
        loaded = status()
        generate(lm.model, lm.encode_prompt(PROMPT), NEW_TOKENS, native=True)
    else:
        peer = llama_cpp_peer(target, "llama.cpp", 1024, "F32")
        assert not isinstance(peer, str), peer
        loaded = status()
        peer.generate(list(range(1, 14)), NEW_TOKENS)  # 13 ids, as the prompt's
    end = status()
    print(json.dumps({"path": path_kind, "target": target, "threads": torch.get_num_threads(),
                      "rss_libraries_mb": base / 1e6,
                      "added_loaded_mb": (loaded["VmRSS"] - base) / 1e6,
                      "added_peak_loading_mb": (loaded["VmHWM"] - base) / 1e6,
                      "added_after_decoding_mb": (end["VmRSS"] - base) / 1e6,
                      "added_peak_mb": (end["VmHWM"] - base) / 1e6}))


if __name__ == "__main__":
    command, *args = sys.argv[1:] or [""]
    if command == "make" and len(args) == 3:
        make(*args)
    elif command == "memory" and len(args) == 2:
        memory(*args)
    else:
        raise SystemExit("usage: bench_quant_decode.py make RUN SOURCE.gguf DIR | "
                         "memory qkv RUN | memory llama.cpp FILE.gguf")
