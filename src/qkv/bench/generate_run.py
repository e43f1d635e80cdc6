"""``qkv bench generate --ckpt RUN``: a run's model decoded by qkv and by its peers.

For any language-model run (an imported open model, a fine-tuned one, a trained GPT),
one process times, round by round with the order rotating:

- qkv: float32 and bfloat16 weights with the KV cache (qkv's C kernels where they run,
  :func:`qkv.models.gpt.generate`'s ``native``), and float32 through the model's own
  forward (the readable path);
- transformers' ``generate`` (float32) on a Hugging Face folder of the same weights, and
  llama.cpp on F32 and BF16 GGUF files of them (:mod:`qkv.bench.peers`; each skipped
  with a note where it is not installed, or where the run is no open family);
- the machine's read bandwidth, a ``sum`` over a 1 GiB buffer, with the same threads,
  before the round's first path and after each path.

Each call decodes ``new_tokens`` greedily after a short prompt. Its decoding rate is
``(n - 1) / (time of the last token - time of the first)``: the one-token steps alone,
the prompt's forward left out. The ceiling is bandwidth / bytes one step reads
(:func:`qkv.bench.lm.decode_bytes_per_token`), per dtype. A shared machine's bandwidth
moves by half from one second to the next, so a path's share of its ceiling is taken
call by call, against the mean of the two readings that bracket the call, and the
median of those shares is reported; the ceiling in tokens/s quoted beside it is the
median of all readings.

The prefill: one forward over a ``prefill_tokens``-long prompt (as matrix products),
computing the last position's logits only, as every path does for a prompt, in prompt
tokens/s, and as a share of the measured matrix-product rate of its dtype (the forward's
multiply-adds, :meth:`GPTConfig.training_flops_per_token` / 3 with the output head's
counted once, over the rate
of one ``(prefill_tokens, emb_dim) @ (emb_dim, hidden_dim)`` product in float32, or in
bfloat16 for the bfloat16 paths).

Context: one more pass decodes ``sweep_tokens`` after prompts of each length in
``contexts``, for every path: tokens/s against the tokens already in the cache, the
plot's right panel.

A quantized run (``qkv lm import FILE.gguf --keep-quantized``) is timed on its blocks:

- ``qkv blocks``: the run as loaded, its matrices in their GGML blocks (qkv's C block
  kernels where they run);
- ``qkv float32``: the same blocks expanded to float32 once (the float import's path);
- ``llama.cpp FILE``: llama.cpp on the very GGUF file the run was imported from (the
  run records its path and SHA-256; a file gone or changed is skipped with a note),
  with a float32 KV cache as qkv's.

Its ceiling is the bandwidth over the bytes a step reads of the blocks (each matrix's
blocks once, one row of an untied embedding, the float vectors, the cache).

Tokens: greedy decoding is deterministic, so qkv's float32 paths and transformers'
must give the same ids; the report says where llama.cpp and the bfloat16 paths first
differ, with the float32 model's top-2 logit margin there (a near-tie goes either way
under another summation order).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.textfile import file_sha256
from ..latent_attention import LatentAttention
from ..models.gguf_model import write_gguf
from ..models.gpt import GPTModel, generate, native_unsupported
from ..models.hf_open import (
    SUPPORTED_TYPES,
    TEXT_MODEL_TYPES,
    from_qkv,
    hf_config,
    write_hf_folder,
)
from ..models.quantized import dequantize_modules, quantized_modules
from ..tasks.lm import LanguageModel
from ..utils.figures import new_figure, save_figure
from .lm import decode_bytes_per_token, read_bandwidth, top2_margin
from .peers import Peer, llama_cpp_peer, transformers_peer
from .timing import machine_info, markdown_table, target_line, write_json

__all__ = ["RunGenerateConfig", "run_generate_run"]

PROMPT = "Once upon a time, in a small village by the sea,"
CEILING_TARGET = 0.80  # qkv float32 decoding, of the bandwidth ceiling
LOW_SPEEDUP_TARGET = 1.6  # qkv bfloat16 over float32
TRANSFORMERS_TARGET = 5.0  # qkv float32 over transformers float32
QUANTIZED_SPEEDUP_TARGET = 3.0  # a Q4_K run's blocks over their float32 expansion


@dataclass
class RunGenerateConfig:
    """What to decode.

    Attributes:
        ckpt: the run folder (``qkv lm train`` or ``qkv lm import``).
        new_tokens: tokens per timed call; repeats: timed rounds; warmup: untimed short
            calls per path first.
        prefill_tokens: prompt length of the prefill measurement (cut to the context).
        contexts: prompt lengths of the context sweep (those that leave room for
            ``sweep_tokens`` in the model's context); sweep_tokens: tokens decoded there.
        peers: time transformers and llama.cpp too (where installed).
        bandwidth_mib: size of the buffer whose ``sum`` measures the read bandwidth.
        seed: of the random token ids of the prefill and sweep prompts.
    """

    ckpt: str
    new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    prefill_tokens: int = 512
    contexts: tuple[int, ...] = (64, 256, 1024, 2048)
    sweep_tokens: int = 16
    peers: bool = True
    bandwidth_mib: int = 1024
    seed: int = 0

    def validate(self) -> None:
        for name in ("new_tokens", "repeats", "prefill_tokens", "sweep_tokens",
                     "bandwidth_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.new_tokens < 2 or self.sweep_tokens < 2:
            raise ValueError("new_tokens and sweep_tokens must be >= 2: a decoding rate "
                             "needs two tokens' times")
        if not self.contexts or any(c < 1 for c in self.contexts):
            raise ValueError(f"contexts must be prompt lengths >= 1, got {self.contexts}")


def _qkv_peer(model: GPTModel, name: str, native: bool) -> Peer:
    """qkv's :func:`generate` as a :class:`Peer`: with ``native``, its C kernels where
    they run the model, else the model's forward (the detail says why)."""
    reason = native_unsupported(model) if native else "native=False"
    native = reason is None

    def run(prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        times: list[float] = []
        out = generate(model, torch.tensor([list(prompt)]), n, native=native,
                       on_token=lambda _: times.append(time.perf_counter()))
        return out[0, len(prompt):].tolist(), times

    def prefill(prompt: Sequence[int]) -> None:
        with torch.no_grad():  # as generate() runs a prompt: the last logits only
            model(torch.tensor([list(prompt)]), caches=model.new_caches(1, len(prompt)),
                  logits_to_keep=1)

    detail = "qkv C kernels" if reason is None else f"model forward ({reason})"
    return Peer(name, run, prefill, detail=detail)


def _decompressed_mla(model: GPTModel) -> GPTModel | None:
    """A copy of ``model`` whose latent attention decompresses the cached latents into
    every head's keys and values at each step (the form the absorbed one avoids), or None
    if it has no latent attention."""
    copy = GPTModel(model.cfg).eval()
    copy.load_state_dict(model.state_dict())
    latent = [m for m in copy.modules() if isinstance(m, LatentAttention)]
    for module in latent:
        module.backend = "decompress"
    return copy if latent else None


def _decode_rate(times: Sequence[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def _peers(lm: LanguageModel, config: RunGenerateConfig, folder: Path,
           log: Callable[[str], None]) -> tuple[dict[str, Peer], dict[str, str]]:
    """The run's model on every path that can run here, and a note for each that cannot."""
    model = lm.model
    if quantized_modules(model):
        return _quantized_peers(lm, config)
    paths = {"qkv float32": _qkv_peer(model, "qkv float32", True)}
    low = GPTModel(model.cfg).eval()
    low.load_state_dict(model.state_dict())
    paths["qkv bfloat16"] = _qkv_peer(low.to(torch.bfloat16), "qkv bfloat16", True)
    paths["qkv float32, model forward"] = _qkv_peer(model, "qkv float32, model forward", False)
    decompressed = _decompressed_mla(model)
    if decompressed is not None:  # the context sweep's reference for the absorbed form
        name = "qkv float32, model forward, MLA decompressed"
        paths[name] = _qkv_peer(decompressed, name, False)
    skipped: dict[str, str] = {}
    if not config.peers:
        return paths, {"peers": "not asked for (--no-peers)"}
    model_type = lm.settings.extra.get("model_type")
    if model_type not in SUPPORTED_TYPES or model_type == "gpt2":
        why = f"the run's model type {model_type!r} is not written out for the peers"
        return paths, {"transformers": why, "llama.cpp": why}
    # a multimodal folder's run is its text model, written as that model's own type
    model_type = TEXT_MODEL_TYPES.get(model_type, model_type)
    fields, state = model.cfg.to_dict(), model.state_dict()
    hf_folder = folder / "hf"
    try:
        write_hf_folder(hf_folder, fields, model_type, state)
        peer = transformers_peer(hf_folder, torch.float32, "transformers float32")
        if not isinstance(peer, str):  # a model transformers loads but cannot run
            peer.generate([1, 2, 3], 2)
            peer.prefill([1, 2, 3])
    except Exception as error:  # noqa: BLE001 - the peer is skipped, qkv's paths still run
        peer = f"{type(error).__name__}: {error}".splitlines()[0]
    if isinstance(peer, str):
        skipped["transformers"] = peer
    else:
        paths[peer.name] = peer
    context = model.cfg.context_length
    try:
        config_json, hf_state = hf_config(fields, model_type), from_qkv(state, fields)
    except ValueError as error:
        skipped["llama.cpp"] = str(error)
        return paths, skipped
    # A run imported from a GGUF file carries that file's tokenizer on (llama.cpp then
    # reads text as the model's own tokenizer does); otherwise ids only.
    source = Path(str(lm.settings.extra.get("source", "")))
    tokenizer = source if source.suffix == ".gguf" and source.is_file() else None
    for dtype in ("F32", "BF16"):
        path = folder / f"model-{dtype}.gguf"
        try:
            write_gguf(path, config_json, hf_state, dtype, tokenizer=tokenizer)
        except ValueError as error:  # a family qkv does not write to GGUF
            skipped["llama.cpp"] = str(error)
            break
        room = max(max(config.contexts) + config.sweep_tokens, 4096)  # the sweep's longest
        peer = llama_cpp_peer(path, f"llama.cpp {dtype}", min(context, room), dtype)
        if isinstance(peer, str):
            skipped["llama.cpp"] = peer
            break
        paths[peer.name] = peer
    log(f"peers' files in {folder} (removed at the end)")
    return paths, skipped


def _quantized_peers(lm: LanguageModel, config: RunGenerateConfig
                     ) -> tuple[dict[str, Peer], dict[str, str]]:
    """A quantized run's paths: its blocks, their float32 expansion, and llama.cpp on the
    GGUF file it was imported from (skipped with a note if gone or changed)."""
    model = lm.model
    expanded = copy.deepcopy(model)
    dequantize_modules(expanded, torch.float32)
    paths = {"qkv blocks": _qkv_peer(model, "qkv blocks", True),
             "qkv float32": _qkv_peer(expanded.eval(), "qkv float32", True)}
    if not config.peers:
        return paths, {"peers": "not asked for (--no-peers)"}
    extra = lm.settings.extra
    source = Path(str(extra.get("source", "")))
    if source.suffix != ".gguf" or not source.is_file():
        return paths, {"llama.cpp": f"the run's source file {source} is not here"}
    if extra.get("source_sha256") not in (None, file_sha256(source, "GGUF file")):
        return paths, {"llama.cpp": f"{source} has changed since the run was imported "
                                    "(its SHA-256 differs)"}
    name = f"llama.cpp {source.name}"
    peer = llama_cpp_peer(source, name, min(model.cfg.context_length, 4096), "F32")
    if isinstance(peer, str):
        return paths, {"llama.cpp": peer}
    return {**paths, name: peer}, {}


def _matmul_rate(rows: int, inner: int, cols: int, dtype: torch.dtype,
                 repeats: int = 5) -> float:
    """FLOP/s of ``(rows, inner) @ (inner, cols)`` in ``dtype``, the median of ``repeats``."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2.0 * rows * inner * cols / statistics.median(times)


def run_generate_run(config: RunGenerateConfig, out_dir: str | Path,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time every path on the run's model, check the tokens, print the tables, write
    ``generate-run.json`` and ``generate-run.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    machine = machine_info(torch.device("cpu"))
    lm = LanguageModel.load(config.ckpt)
    lm.model = lm.model.float()  # a run stored in bfloat16 too: each path picks its dtype
    prompt = lm.encode_prompt(PROMPT)[0].tolist()
    n_params = lm.model.cfg.num_parameters()  # (a quantized layer's too)
    log(f"generate: {lm.title} ({n_params:,} parameters), {len(prompt)}-token prompt, "
        f"{config.new_tokens} new tokens, batch 1, {torch.get_num_threads()} threads")
    # A folder of this run's own: two runs into one --out must not delete each other's.
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="peer-files-", dir=out_dir))
    paths: dict[str, Peer] = {}
    try:
        paths, skipped = _peers(lm, config, folder, log)
        for name, why in skipped.items():
            log(f"skipped {name}: {why}")
        report = _measure(lm, config, paths, prompt, log)
    finally:
        for peer in paths.values():
            peer.close()
        shutil.rmtree(folder, ignore_errors=True)
    report.update({"suite": "generate-run", "config": dataclasses.asdict(config),
                   "machine": machine, "model": lm.title, "parameters": n_params,
                   "skipped": skipped})
    if quantized_modules(lm.model):
        report["kept_types"] = sorted(set(quantized_modules(lm.model).values()))
        report["targets"] = _targets(report)
    log("")
    log(table(report))
    log("")
    for line in report["notes"]:
        log(line)
    log("")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "generate-run.json", report)
    plot(report, out_dir / "generate-run.png")
    log(f"\nwrote {out_dir / 'generate-run.json'} and {out_dir / 'generate-run.png'}")
    return report


def _measure(lm: LanguageModel, config: RunGenerateConfig, paths: dict[str, Peer],
             prompt: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    model, cfg = lm.model, lm.model.cfg
    g = torch.Generator().manual_seed(config.seed)
    buffer = torch.ones(config.bandwidth_mib * 2**20 // 4)
    sums = 3
    bandwidth_call = read_bandwidth(buffer, sums)
    for _ in range(config.warmup):
        bandwidth_call()
        for peer in paths.values():
            peer.generate(prompt, 4)
    names = list(paths)
    rates: dict[str, list[float]] = {name: [] for name in names}
    totals: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    bandwidth: list[float] = []  # every reading, in order
    around: dict[str, list[float]] = {name: [] for name in names}  # each call's bracket

    read_bytes = sums * buffer.nbytes

    def read() -> float:
        start = time.perf_counter()
        bandwidth_call()
        bandwidth.append(read_bytes / (time.perf_counter() - start))
        return bandwidth[-1]

    log(f"timing: {len(names)} paths x {config.repeats} rounds, the read bandwidth "
        "between them")
    for r in range(config.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        before = read()
        for name in order:
            start = time.perf_counter()
            out, times = paths[name].generate(prompt, config.new_tokens)
            totals[name].append(config.new_tokens / (time.perf_counter() - start))
            rates[name].append(_decode_rate(times))
            tokens[name] = out
            after = read()
            around[name].append((before + after) / 2)
            before = after
        log(f"  round {r + 1}/{config.repeats}: " + ", ".join(
            f"{n} {rates[n][-1]:.1f}" for n in names) + " tokens/s")
    del buffer
    bw = statistics.median(bandwidth)
    quantized = bool(quantized_modules(model))
    # (a quantized run's float32 bytes: its float model's, counted on the meta device)
    f32 = decode_bytes_per_token(cfg.meta_model() if quantized else model, len(prompt),
                                 config.new_tokens)
    # the bfloat16 path holds every parameter and its cache in 2 bytes instead of 4
    per_token = {"float32": f32, "bfloat16": {
        k: v / 2 if k in ("weights", "kv_cache", "total") else v for k, v in f32.items()}}
    if quantized:  # the blocks' paths: qkv's and llama.cpp's on the same file
        per_token = {"blocks": decode_bytes_per_token(model, len(prompt), config.new_tokens),
                     "float32": f32}
    ceiling = {dtype: bw / b["total"] for dtype, b in per_token.items()}

    # prefill: one forward over a long prompt, each path, median of the rounds
    n_prefill = min(config.prefill_tokens, cfg.context_length)
    long_prompt = torch.randint(0, cfg.vocab_size, (n_prefill,), generator=g).tolist()
    prefill: dict[str, float] = {}
    for name, peer in paths.items():
        if "model forward" in name:
            continue  # the same forward as qkv float32's prefill
        peer.prefill(long_prompt[:16])
        samples = []
        for _ in range(config.repeats):
            start = time.perf_counter()
            peer.prefill(long_prompt)
            samples.append(n_prefill / (time.perf_counter() - start))
        prefill[name] = statistics.median(samples)
    hidden = cfg.hidden_dim or 4 * cfg.emb_dim
    # each dtype's own rate: a CPU with AMX or AVX512-BF16 multiplies bfloat16 faster
    matmul = {name: _matmul_rate(n_prefill, cfg.emb_dim, hidden, dtype)
              for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    # the forward's products, with the output head for the last position only (as every
    # path runs a prompt)
    head = 2.0 * cfg.vocab_size * cfg.emb_dim
    flops_per_token = cfg.training_flops_per_token(n_prefill) / 3 - head * (n_prefill - 1) \
        / n_prefill

    # context sweep
    sweep: dict[str, dict[int, float]] = {name: {} for name in names}
    for c in config.contexts:
        if c + config.sweep_tokens > cfg.context_length:
            continue
        ids = torch.randint(0, cfg.vocab_size, (c,), generator=g).tolist()
        for name, peer in paths.items():
            _, times = peer.generate(ids, config.sweep_tokens)
            sweep[name][c] = _decode_rate(times)
        log(f"  context {c}: " + ", ".join(f"{n} {sweep[n][c]:.1f}" for n in names))

    results = {}
    for name in names:
        dtype = "bfloat16" if "bfloat16" in name or "BF16" in name else "float32"
        if quantized and name != "qkv float32":
            dtype = "blocks"
        median = statistics.median(rates[name])
        shares = [100 * rate * per_token[dtype]["total"] / bw_around
                  for rate, bw_around in zip(rates[name], around[name], strict=True)]
        results[name] = {
            "decoder": paths[name].detail, "dtype": dtype,
            "tokens_per_sec": {"median": median, "min": min(rates[name]),
                               "max": max(rates[name]), "samples": rates[name]},
            "total_tokens_per_sec": statistics.median(totals[name]),
            "bandwidth_around": around[name],
            "percent_of_ceiling": statistics.median(shares),
            "prefill_tokens_per_sec": prefill.get(name),
            "prefill_percent_of_matmul": (100 * prefill[name] * flops_per_token
                                          / matmul[dtype if dtype != "blocks" else "float32"]
                                          if name in prefill else None),
            "sweep_tokens_per_sec": sweep[name],
        }
    reference = tokens["qkv float32"]
    identity = {}
    for name, out in tokens.items():
        diff = next((i for i, (a, b) in enumerate(zip(out, reference, strict=True)) if a != b),
                    None)
        margin = None
        if diff is not None:
            ids = torch.tensor([prompt + reference])
            margin = top2_margin(model, ids, len(prompt) + diff, cfg.context_length)
        identity[name] = {"identical": diff is None, "first_difference": diff,
                          "margin": margin}
    report: dict[str, Any] = {
        "results": results, "prompt": prompt, "tokens": reference, "identity": identity,
        "bandwidth_bytes_per_sec": {"median": bw, "samples": bandwidth,
                                    "buffer_mib": config.bandwidth_mib},
        "bytes_per_token": per_token, "ceiling_tokens_per_sec": ceiling,
        "matmul_flops_per_sec": matmul, "prefill_tokens": n_prefill,
        "forward_flops_per_token": flops_per_token,
    }
    report["notes"] = _notes(report)
    report["targets"] = _targets(report)
    return report


def _notes(report: dict[str, Any]) -> list[str]:
    bw = report["bandwidth_bytes_per_sec"]
    lines = [f"read bandwidth (sum over {bw['buffer_mib']:,} MiB, median of "
             f"{len(bw['samples'])} readings between the calls): {bw['median'] / 1e9:.1f} "
             f"GB/s ({min(bw['samples']) / 1e9:.1f}-{max(bw['samples']) / 1e9:.1f}); each "
             "path's share of its ceiling is the median over its calls, each against "
             "the readings just before and after it"]
    for dtype, b in report["bytes_per_token"].items():
        lines.append(f"{dtype}: {b['total'] / 1e6:.1f} MB read per token (weights "
                     f"{b['weights'] / 1e6:.1f} MB + KV cache {b['kv_cache'] / 1e6:.2f} MB) "
                     f"-> ceiling {report['ceiling_tokens_per_sec'][dtype]:.1f} tokens/s")
    rates = report["matmul_flops_per_sec"]
    lines.append(f"matrix products ({report['prefill_tokens']} rows): "
                 + ", ".join(f"{d} {r / 1e9:.0f} GFLOP/s" for d, r in rates.items())
                 + f"; the forward is {report['forward_flops_per_token'] / 1e6:.0f} MFLOP "
                   "per token")
    for name, same in report["identity"].items():
        if name == "qkv float32":
            continue
        if same["identical"]:
            lines.append(f"tokens, {name} vs qkv float32: identical")
        else:
            lines.append(f"tokens, {name} vs qkv float32: differ from generated position "
                         f"{same['first_difference']} (float32 top-2 logit margin there: "
                         f"{same['margin']:.3g})")
    return lines


def _targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    res = report["results"]

    def tps(name: str) -> float:
        return res[name]["tokens_per_sec"]["median"]

    out = []
    pct = res["qkv float32"]["percent_of_ceiling"]
    out.append({"name": f"qkv float32 decoding >= {CEILING_TARGET:.0%} of the bandwidth "
                        "ceiling", "value": pct / 100, "threshold": CEILING_TARGET,
                "met": pct / 100 >= CEILING_TARGET, "value_text": f"{pct:.0f} %"})
    if "qkv blocks" in res:
        return out + _block_targets(report)
    low = tps("qkv bfloat16") / tps("qkv float32")
    out.append({"name": f"qkv bfloat16 >= {LOW_SPEEDUP_TARGET}x qkv float32",
                "value": low, "threshold": LOW_SPEEDUP_TARGET,
                "met": low >= LOW_SPEEDUP_TARGET, "value_text": f"{low:.2f}x"})
    if "transformers float32" in res:
        ratio = tps("qkv float32") / tps("transformers float32")
        out.append({"name": f"qkv float32 >= {TRANSFORMERS_TARGET:g}x transformers float32",
                    "value": ratio, "threshold": TRANSFORMERS_TARGET,
                    "met": ratio >= TRANSFORMERS_TARGET, "value_text": f"{ratio:.1f}x"})
    for ours, theirs in (("qkv float32", "llama.cpp F32"), ("qkv bfloat16", "llama.cpp BF16")):
        if theirs in res:
            ratio = tps(ours) / tps(theirs)
            out.append({"name": f"{ours} at least level with {theirs}", "value": ratio,
                        "threshold": 1.0, "met": ratio >= 1.0,
                        "value_text": f"{ratio:.2f}x"})
    same = [n for n in ("qkv float32, model forward", "transformers float32")
            if n in report["identity"]]
    met = all(report["identity"][n]["identical"] for n in same)
    out.append({"name": "greedy tokens identical: qkv float32 kernels, qkv model forward, "
                        "transformers float32", "value": float(met), "threshold": 1.0,
                "met": met, "value_text": "identical" if met else "differ"})
    return out


def _block_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A quantized run's targets: its blocks decoded at least at llama.cpp's rate on the
    same file, and (Q4_K files) at 3x its own float32 expansion."""
    res = report["results"]

    def tps(name: str) -> float:
        return res[name]["tokens_per_sec"]["median"]

    out = []
    for theirs in (n for n in res if n.startswith("llama.cpp")):
        ratio = tps("qkv blocks") / tps(theirs)
        out.append({"name": f"qkv blocks at least level with {theirs}", "value": ratio,
                    "threshold": 1.0, "met": ratio >= 1.0, "value_text": f"{ratio:.2f}x"})
    ratio = tps("qkv blocks") / tps("qkv float32")
    threshold = QUANTIZED_SPEEDUP_TARGET if "Q4_K" in report.get("kept_types", ()) else 1.0
    out.append({"name": f"qkv blocks >= {threshold:g}x qkv float32", "value": ratio,
                "threshold": threshold, "met": ratio >= threshold,
                "value_text": f"{ratio:.2f}x"})
    return out


def table(report: dict[str, Any]) -> str:
    rows = []
    for name, r in report["results"].items():
        t = r["tokens_per_sec"]
        pre = r["prefill_tokens_per_sec"]
        rows.append([name, r["decoder"], f"{t['median']:.1f}", f"{t['min']:.1f}-{t['max']:.1f}",
                     f"{r['percent_of_ceiling']:.0f} %",
                     "" if pre is None else f"{pre:.0f}",
                     "" if pre is None else f"{r['prefill_percent_of_matmul']:.0f} %"])
    return markdown_table(["path", "runs on", "decode tokens/s", "min-max", "of ceiling",
                           f"prefill tokens/s ({report['prefill_tokens']})",
                           "of matmul rate"], rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Left: decoding tokens/s of every path with each dtype's ceiling. Right: tokens/s
    against the tokens already in the cache."""
    fig = new_figure(12, 4.5)
    left, right = fig.subplots(1, 2)
    names = list(report["results"])
    values = [report["results"][n]["tokens_per_sec"]["median"] for n in names]
    colors = ["tab:blue" if n.startswith("qkv") else "tab:orange"
              if n.startswith("transformers") else "tab:green" for n in names]
    left.barh(names, values, color=colors)
    for dtype, c in report["ceiling_tokens_per_sec"].items():
        left.axvline(c, color="gray", linestyle="--" if dtype == "float32" else ":",
                     label=f"{dtype} ceiling {c:.0f}")
    left.invert_yaxis()
    left.set_xlabel("decoding tokens/s (median)")
    left.legend(fontsize=8)
    for name, color in zip(names, colors, strict=True):
        sweep = report["results"][name]["sweep_tokens_per_sec"]
        if sweep:
            # JSON keys are strings: the report read back plots as the report made
            points = sorted((int(c), rate) for c, rate in sweep.items())
            style = ":" if "bfloat16" in name or "BF16" in name else \
                "-." if "decompressed" in name else \
                "--" if name.endswith("model forward") else "-"
            right.plot([c for c, _ in points], [r for _, r in points], style, marker="o",
                       color=color, label=name)
    right.set_xscale("log", base=2)
    right.set_ylim(bottom=0)
    right.set_xlabel("tokens in the cache (prompt length)")
    right.set_ylabel("decoding tokens/s")
    right.legend(fontsize=7, loc="lower left", ncol=2)
    fig.suptitle(f"{report['model']}: greedy decoding, batch 1, "
                 f"{report['machine']['torch_threads']} threads", fontsize=10)
    return save_figure(fig, path)
