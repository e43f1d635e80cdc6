"""Each model's float32 decoding rate as a share of the read bandwidth measured just
before and just after it, several models interleaved, for issue 34's ceiling target.

    OMP_NUM_THREADS=2 python scripts/bandwidth_pairs.py ROUNDS RUN [RUN ...]

A shared machine's read bandwidth moves by half from one second to the next, so one
reading per round of several paths (as ``qkv bench generate --ckpt`` once took) can
set a decoder against a bandwidth it never had. Here each call of 48 greedy native
steps (after a 13-token prompt) sits between two ``sum`` readings over 1 GiB (three
sums each), and its bytes per second (:func:`qkv.bench.lm.decode_bytes_per_token`
times its decoding rate) are divided by their mean. Rounds rotate the models' order;
prints every call, then each model's median share and median GB/s.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from qkv.bench.lm import decode_bytes_per_token, read_bandwidth
from qkv.models.gpt import generate
from qkv.tasks.lm import LanguageModel

STEPS, PROMPT = 48, list(range(5, 18))


def main(rounds: int, runs: list[str]) -> None:
    models = {}
    for run in runs:
        model = LanguageModel.load(run).model.float().eval()
        read = decode_bytes_per_token(model, len(PROMPT), STEPS)["total"]
        models[run] = (model, read)
        print(f"{run}: {read / 1e6:.1f} MB read per token", flush=True)
    buffer = torch.ones(2**28)
    probe = read_bandwidth(buffer, 3)
    prompt = torch.tensor([PROMPT])

    def bandwidth() -> float:
        start = time.perf_counter()
        probe()
        return 3 * buffer.nbytes / (time.perf_counter() - start)

    for model, _ in models.values():
        generate(model, prompt, 4, native=True)
    shares: dict[str, list[float]] = {run: [] for run in runs}
    rates: dict[str, list[float]] = {run: [] for run in runs}
    for r in range(rounds):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            model, read = models[run]
            before = bandwidth()
            times: list[float] = []
            generate(model, prompt, STEPS, native=True,
                     on_token=lambda _, times=times: times.append(time.perf_counter()))
            after = bandwidth()
            got = read * (len(times) - 1) / (times[-1] - times[0])
            shares[run].append(got / ((before + after) / 2))
            rates[run].append(got)
            print(f"round {r} {run}: bandwidth {before / 1e9:.1f} / {after / 1e9:.1f} GB/s, "
                  f"decoding {got / 1e9:.1f} GB/s, share {shares[run][-1]:.2f}", flush=True)
    for run in runs:
        print(f"{run}: median share {statistics.median(shares[run]):.2f}, median "
              f"{statistics.median(rates[run]) / 1e9:.1f} GB/s, shares "
              + " ".join(f"{x:.2f}" for x in shares[run]))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: bandwidth_pairs.py ROUNDS RUN [RUN ...]")
    main(int(sys.argv[1]), sys.argv[2:])
