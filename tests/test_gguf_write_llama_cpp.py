"""llama.cpp (llama-cpp-python) runs ``write_gguf``'s files of the families of mixed
layers as transformers runs the models: logits on a few ids within 1e-4 of the largest
(llama.cpp sums float32 in another order), the KV cache float32. Skipped unless
``llama_cpp`` imports (it is not part of CI).

ggml computes GELU (Gemma 4's) from a table of its values at every float16 input: the
transformers model is given that GELU too, and the logits may differ by 1e-3 of the
largest (an input that rounds to the neighbouring float16 moves one value by a unit in
the last place of float16).

DeepSeek-V3.2's test model has 16 index heads: a key's index score is exactly 0 only
when every head's ReLU is, and ties at the edge of the selection, which ggml's top-k and
PyTorch's break differently, do not occur (with test_open_models' 2 heads they do, and
the logits past them differ by units)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from qkv.models.gguf_model import write_gguf  # noqa: E402
from test_gguf_write_families import FAMILIES, SPECS  # noqa: E402


class Float16TableGelu(torch.nn.Module):
    """ggml's GELU (tanh form): its float32 value at the input rounded to float16, rounded
    to float16; 0 at or below -10, the input itself at or above 10."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = F.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_the_written_file(tmp_path, family):
    """F32 files (in BF16 llama.cpp rounds the activations to bfloat16 too: no match to
    1e-4 is due there)."""
    model = SPECS[family][0](family)
    gelu = family == "gemma4_text"
    if gelu:
        for module in model.modules():
            if hasattr(module, "act_fn"):
                module.act_fn = Float16TableGelu()
    path = write_gguf(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True,
                          type_k=f32, type_v=f32, verbose=False)
    try:
        ids = [(7 * i + 3) % model.config.vocab_size for i in range(20)]  # past windows
        llm.eval(ids)
        theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    finally:
        llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    scale = float(want.abs().max())
    torch.testing.assert_close(theirs, want, rtol=0, atol=(1e-3 if gelu else 1e-4) * scale)
