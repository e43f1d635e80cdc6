"""qkv's head catalogue against TransformerLens 4's head detectors on the same random
GPT-2-small-shaped model (a transformers folder both read), on qkv's induction batch.

    python -c "import torch; from transformers import GPT2Config, GPT2LMHeadModel; \
        torch.manual_seed(0); \
        GPT2LMHeadModel(GPT2Config()).save_pretrained('/tmp/gpt2-small-random')"
    # and GPT-2's tokenizer files saved into that folder (GPT2TokenizerFast.save_pretrained)
    pip install --no-deps transformer_lens==4.3.0 && pip install einops jaxtyping datasets
    flock bench.lock python scripts/heads_vs_transformer_lens.py
"""
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it

import torch  # noqa: E402
from transformer_lens.head_detector import (  # noqa: E402
    compute_head_attention_similarity_score,
    get_duplicate_token_head_detection_pattern,
    get_induction_head_detection_pattern,
    get_previous_token_head_detection_pattern,
)
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import GPT2TokenizerFast  # noqa: E402

from qkv.heads.scores import InductionProtocol, head_scores  # noqa: E402
from qkv.models.gpt import GPTModel  # noqa: E402

folder = "/tmp/gpt2-small-random"
ours = GPTModel.from_hf(folder).eval()
tl = TransformerBridge.boot_transformers(
    folder, tokenizer=GPT2TokenizerFast.from_pretrained(folder))
tl.enable_compatibility_mode()
ids = InductionProtocol(bos_id=50256).ids(50257)  # (10, 101)
patterns = (get_previous_token_head_detection_pattern, get_duplicate_token_head_detection_pattern,
            get_induction_head_detection_pattern)


def run_qkv():
    with torch.inference_mode():
        return head_scores(ours, ids, repeat=50)


def run_tl():
    out = torch.zeros(3, 12, 12)
    with torch.inference_mode():
        for seq in ids:  # as detect_head does for a list of sequences: one at a time
            _, cache = tl.run_with_cache(seq[None])
            for p, make in enumerate(patterns):
                det = make(seq[None].cpu())
                for layer in range(12):
                    pat = cache["pattern", layer][0]
                    for head in range(12):
                        out[p, layer, head] += compute_head_attention_similarity_score(
                            pat[head], detection_pattern=det, exclude_bos=False,
                            exclude_current_token=False, error_measure="mul")
    return out / len(ids)


table, tlout = run_qkv(), run_tl()
prev_q = torch.tensor([[r["previous_token"] for r in table if r["layer"] == layer]
                       for layer in range(12)])
print(f"previous-token: qkv mean {prev_q.mean():.4f}, TransformerLens mean "
      f"{tlout[0].mean():.4f} (its score: 'mul' similarity)")
a, b = [], []
for _ in range(5):
    t = time.perf_counter()
    run_qkv()
    a.append(time.perf_counter() - t)
    t = time.perf_counter()
    run_tl()
    b.append(time.perf_counter() - t)
print(f"threads {torch.get_num_threads()}; qkv head_scores (8 scores, 144 heads): median "
      f"{statistics.median(a):.3f} s (min {min(a):.3f}); TransformerLens 4.3 run_with_cache + "
      f"3 detectors: median {statistics.median(b):.3f} s (min {min(b):.3f}); "
      f"qkv {statistics.median(b) / statistics.median(a):.1f}x faster")
