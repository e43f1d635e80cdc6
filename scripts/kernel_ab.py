"""Interleaved A/B of builds of the decoding kernels on one run, llama.cpp beside them.

Each round runs every variant once, in rotating order, each in a fresh process with its
own environment (so each loads the library its settings build: ``QKV_NATIVE_AVX512``,
``QKV_NATIVE_VNNI``, ``QKV_NATIVE_PREFETCH``), and measures the read bandwidth (a
``sum`` over 1 GiB) once. A variant's rate is the median over the rounds; the ratios are
the medians of the per-round ratios to the first variant, which a host whose bandwidth
moves from one minute to the next leaves steadier than the rates.

    python scripts/kernel_ab.py RUN --dtype float32 --rounds 8 \\
        --variant default= --variant prefetch=QKV_NATIVE_PREFETCH=1 \\
        --variant avx2=QKV_NATIVE_AVX512=0 --llama-cpp model-F32.gguf

``--llama-cpp FILE`` adds llama.cpp on that GGUF file (``write_gguf`` of the same
weights: F32 beside float32, BF16 beside bfloat16), through qkv's bench peer; put the
``llama_cpp`` package on ``PYTHONPATH``. ``--llama-cpp-path DIR`` runs it with another
build of it (prepended to ``PYTHONPATH``, e.g. an AVX2 build beside the native one).
``--context N`` times the steps after an N-token prompt: a point of the context sweep
in interleaved rounds, which one round of ``qkv bench generate --contexts`` is not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

# One timed decode: the run in DTYPE, 8 greedy tokens to warm, then 128 timed, each
# after a prompt of CONTEXT ids (1 .. 1,000 repeating).
QKV_CHILD = """
import json, sys, time, torch
from qkv.models.gpt import generate
from qkv.tasks.lm import LanguageModel
run, dtype, n, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
model = LanguageModel.load(run).model.to(getattr(torch, dtype))
ids = torch.tensor([[1 + i % 1000 for i in range(context)]])
generate(model, ids, 8, native=True)
times = []
generate(model, ids, n, native=True, on_token=lambda _: times.append(time.perf_counter()))
print(json.dumps((n - 1) / (times[-1] - times[0])))
"""
LLAMA_CHILD = """
import json, sys
from qkv.bench.peers import llama_cpp_peer
path, dtype, n, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
peer = llama_cpp_peer(path, "llama.cpp", max(4096, context + n + 16),
                      "F32" if dtype == "float32" else "BF16")
if isinstance(peer, str):
    sys.exit(peer)
ids = [1 + i % 1000 for i in range(context)]
peer.generate(ids, 8)
_, times = peer.generate(ids, n)
print(json.dumps((n - 1) / (times[-1] - times[0])))
"""
BANDWIDTH_CHILD = """
import json, time, torch
from qkv.bench.lm import read_bandwidth
torch.set_num_threads(2)
buffer = torch.ones(2**28)
call = read_bandwidth(buffer, 3)
call()
start = time.perf_counter()
call()
print(json.dumps(3 * buffer.nbytes / (time.perf_counter() - start) / 1e9))
"""


def child(code: str, args: list[str], env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", code, *args], env={**os.environ, **env},
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"a child failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``name=VAR=VALUE,VAR=VALUE`` (``name=`` for the environment as it is)."""
    name, _, settings = text.partition("=")
    # settings split at the commas that start another VAR= (a value may hold commas:
    # OMP_SCHEDULE=dynamic,32)
    env = dict(item.split("=", 1) for item in re.split(r",(?=[A-Za-z_]\w*=)", settings)
               if item)
    if not name:
        raise argparse.ArgumentTypeError(f"a variant needs a name: {text!r}")
    return name, env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=8,
                        help="prompt length: the tokens cached before the timed ones")
    parser.add_argument("--variant", type=variant, action="append", required=True)
    parser.add_argument("--llama-cpp", metavar="FILE")
    parser.add_argument("--llama-cpp-path", metavar="DIR")
    args = parser.parse_args()
    if args.context < 1:
        parser.error(f"--context must be at least 1, got {args.context}")
    lengths = [str(args.tokens), str(args.context)]
    paths = [(name, QKV_CHILD, [args.run, args.dtype, *lengths], env)
             for name, env in args.variant]
    if args.llama_cpp:
        env = {}
        if args.llama_cpp_path:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (args.llama_cpp_path, os.environ.get("PYTHONPATH")) if p)
        paths.append(("llama.cpp", LLAMA_CHILD, [args.llama_cpp, args.dtype, *lengths],
                      env))
    rates: dict[str, list[float]] = {name: [] for name, *_ in paths}
    bandwidth = []
    for r in range(args.rounds):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for name, code, child_args, env in order:
            rates[name].append(child(code, child_args, env))
        bandwidth.append(child(BANDWIDTH_CHILD, [], {}))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items())
              + f" tok/s; read bandwidth {bandwidth[-1]:.1f} GB/s", flush=True)
    first = paths[0][0]
    print(f"\n{args.run}, {args.dtype}, {args.context} cached tokens, {args.rounds} rounds, "
          "medians "
          f"(read bandwidth {statistics.median(bandwidth):.1f} GB/s):")
    for name, values in rates.items():
        ratio = statistics.median(a / b for a, b in zip(values, rates[first], strict=True))
        print(f"  {name:24s} {statistics.median(values):7.1f} tok/s  "
              f"{ratio:.3f}x {first} (per-round median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
