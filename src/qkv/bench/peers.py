"""What a practitioner would otherwise run the same weights on: transformers and llama.cpp.

Each peer is a :class:`Peer`: greedy decoding of ``n`` new tokens after a prompt of token
ids, with the KV cache, returning the new ids, and a prompt-only forward (the prefill).
They read the weights qkv runs, written out in each tool's own format
(:func:`qkv.models.hf_open.write_hf_folder`, :func:`qkv.models.gguf_model.write_gguf`):
the same numbers, so the greedy tokens can be compared one for one.

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(folder, dtype=...)`` and its
  ``generate(do_sample=False, use_cache=True)``, with ``min_new_tokens`` so that an
  end-of-sequence token does not stop it early (qkv's timed calls do not stop either);
- ``llama.cpp`` (``llama-cpp-python``, which builds llama.cpp from its source package):
  ``Llama(model_path)`` on a GGUF file, fed token ids; each new token is the argmax of the
  last logits (llama.cpp's own greedy sampler picks the same).

Neither is a dependency of qkv: :func:`transformers_peer` and :func:`llama_cpp_peer`
return a one-line reason instead of a peer where the tool is not installed, and the
benchmark reports it as skipped. Both run on the CPU with the threads PyTorch has.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Peer", "llama_cpp_logits", "llama_cpp_peer", "transformers_peer"]

TokenTimes = list[float]


@dataclass
class Peer:
    """One way to decode: ``generate(prompt, n) -> (new ids, per-token times)``, the
    times ``time.perf_counter()`` as each new token became known, and ``prefill(prompt)``,
    one forward over the prompt that fills the cache."""

    name: str
    generate: Callable[[Sequence[int], int], tuple[list[int], TokenTimes]]
    prefill: Callable[[Sequence[int]], None]
    detail: str = ""
    close: Callable[[], None] = field(default=lambda: None)


def transformers_peer(folder: str | Path, dtype: torch.dtype, name: str) -> Peer | str:
    """transformers' ``generate`` on the Hugging Face folder ``folder``, in ``dtype``, or
    why it cannot run here."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    class Clock(transformers.generation.BaseStreamer):
        """Notes the time each new token arrives (the first call is the prompt)."""

        def __init__(self) -> None:
            self.times: TokenTimes = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    def generate(prompt: Sequence[int], n: int) -> tuple[list[int], TokenTimes]:
        clock = Clock()
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, use_cache=True,
                                 streamer=clock, pad_token_id=0)
        return out[0, len(prompt):].tolist(), clock.times

    def prefill(prompt: Sequence[int]) -> None:
        with torch.no_grad():  # as its generate() runs a prompt: the last logits only
            model(torch.tensor([list(prompt)]), use_cache=True, logits_to_keep=1)

    return Peer(name, generate, prefill,
                detail=f"transformers {transformers.__version__}, "
                       f"{model.config._attn_implementation} attention")


def llama_cpp_peer(gguf: str | Path, name: str, context: int, dtype: str) -> Peer | str:
    """llama.cpp on the GGUF file ``gguf`` (weights of ``dtype``, ``"F32"`` or ``"BF16"``)
    with room for ``context`` tokens, or why it cannot run here.

    The KV cache is kept in float32 for F32 weights, as qkv keeps it (llama.cpp's
    default, float16, reads half the cache bytes per step and rounds every key and
    value), and in llama.cpp's default float16 for BF16 weights, the size of qkv's
    bfloat16 cache."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (pip install llama-cpp-python builds "
                "llama.cpp from source)")
    import llama_cpp
    import numpy as np

    threads = torch.get_num_threads()
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} \
        if dtype == "F32" else {}
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_batch=min(context, 512),
                              n_threads=threads, n_threads_batch=threads, logits_all=False,
                              verbose=False, **cache)
    except ValueError as error:  # its loader refused the file (llama-cpp-python's message)
        return f"llama.cpp cannot load {gguf}: {error}"

    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # the last evaluated position's logits, where llama.cpp keeps them (Llama.scores
        # holds them only with logits_all, which would copy every prompt position's)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(vocab,))

    def generate(prompt: Sequence[int], n: int) -> tuple[list[int], TokenTimes]:
        llm.reset()
        llm.eval(list(prompt))
        out: list[int] = []
        times: TokenTimes = []
        for i in range(n):
            token = int(np.argmax(last_logits()))
            out.append(token)
            times.append(time.perf_counter())
            if i + 1 < n:  # the last token needs no step of its own
                llm.eval([token])
        return out, times

    def prefill(prompt: Sequence[int]) -> None:
        llm.reset()
        llm.eval(list(prompt))

    return Peer(name, generate, prefill, detail=f"llama-cpp-python {llama_cpp.__version__}",
                close=llm.close)


def llama_cpp_logits(gguf: str | Path, window: int
                     ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], None]] | str:
    """llama.cpp's logits at every position of a chunk of ids, as a model's forward
    gives them, ``(1, T) -> (1, T, vocab)`` float32 with ``T <= window``, and a function
    that frees the model; or why it cannot run here.

    Each call starts from an empty cache (``reset``) and evaluates the chunk in one
    batch with every position's logits kept (``logits_all``), as ``llama-perplexity``
    does for each of its chunks. The KV cache is float32, as qkv's, so that a difference
    from qkv's logits is the weights' arithmetic, not the cache's rounding."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (pip install llama-cpp-python builds "
                "llama.cpp from source)")
    import llama_cpp
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=window, n_batch=window,
                          n_ubatch=window, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] > window:
            raise ValueError(f"llama.cpp's logits take ids (1, T <= {window}), got "
                             f"{tuple(ids.shape)}")
        llm.reset()
        llm.eval(ids[0].tolist())
        return torch.from_numpy(llm.scores[:ids.shape[1]].copy())[None]

    return forward, llm.close
