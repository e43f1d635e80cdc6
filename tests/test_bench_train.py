"""``qkv bench train``: the report's structure, its arithmetic, its refusals, and the FLOP
count it rests on. No timing is asserted (this machine is shared; the numbers are noise
at these sizes): rates are only checked to be finite and positive.
"""

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qkv import cli
from qkv.bench import train
from qkv.models.gpt import GPTConfig, GPTModel
from qkv.training import InsufficientMemoryError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``qkv bench train --quick`` through the command line's main, once for the module."""
    out = tmp_path_factory.mktemp("train")
    code = cli.main(["bench", "train", "--quick", "--device", "cpu", "--out", str(out)])
    return code, out


def finite_positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_quick_run_writes_the_report_and_the_plot(quick_run):
    from matplotlib.image import imread

    code, out = quick_run
    assert code == 0
    report = json.loads((out / "train.json").read_text())
    assert report["suite"] == "train" and report["machine"]["torch"] == torch.__version__
    assert report["baseline"] == "float32" and report["dtype"] == "float32"
    assert list(report["options"]) == ["float32", "bfloat16", "float32+eager-attn"]
    assert set(report["matmul"]) == {"float32", "bfloat16"}
    assert all(finite_positive(m["flops_per_sec"]) for m in report["matmul"].values())
    assert report["targets"] == []  # the target is a CUDA one
    tiny = report["results"]["tiny"]
    assert (tiny["batch_size"], tiny["context_length"], tiny["steps"]) == (2, 32, 2)
    assert tiny["flops_per_token"] == GPTConfig.preset("tiny").training_flops_per_token(32)
    for key, case in tiny["cases"].items():
        assert case["status"] == "ok", (key, case.get("reason"))
        assert case["timed_epochs"] == len(case["tokens_per_sec"]["samples"]) == 2
        assert len(case["warmup_seconds"]) == 1 and case["stopped"] is None
        for field in ("tokens_per_sec", "model_flops_per_sec", "mfu"):
            assert all(finite_positive(x) for x in case[field]["samples"]), (key, field)
        assert math.isfinite(case["loss"])
    assert tiny["cases"]["float32"]["ratio_to_baseline"] == 1.0
    assert tiny["cases"]["bfloat16"]["dtype"] == "bfloat16"
    assert tiny["cases"]["float32+eager-attn"]["attention"] == "eager"
    assert (out / "train.png").read_bytes()[:8] == PNG_SIGNATURE
    assert imread(out / "train.png").shape[0] > 50


def test_mfu_is_model_flops_over_the_matmul_rate(quick_run):
    # By hand: 1 GFLOP per token at 50 tokens/s is 50 GFLOP/s, half of 100 GFLOP/s.
    assert train.model_flops_utilisation(1e9, 50.0, 1e11) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be > 0"):
        train.model_flops_utilisation(1e9, 50.0, 0.0)
    # The report's figures follow the same arithmetic, from its own numbers, each dtype
    # against its own ceiling.
    _, out = quick_run
    report = json.loads((out / "train.json").read_text())
    tiny = report["results"]["tiny"]
    for case in tiny["cases"].values():
        ceiling = report["matmul"][case["dtype"]]["flops_per_sec"]
        for tps, flops, mfu in zip(case["tokens_per_sec"]["samples"],
                                   case["model_flops_per_sec"]["samples"],
                                   case["mfu"]["samples"], strict=True):
            assert flops == pytest.approx(tiny["flops_per_token"] * tps)
            assert mfu == pytest.approx(tiny["flops_per_token"] * tps / ceiling)


def test_the_table_has_every_option_set(quick_run):
    _, out = quick_run
    report = json.loads((out / "train.json").read_text())
    text = train.table(report, "tiny")
    for label in ("float32", "bfloat16 autocast", "float32, eager attention", "MFU",
                  "x float32"):
        assert label in text


@pytest.mark.parametrize("fields, message", [
    ({"presets": ("gpt5",)}, "unknown preset 'gpt5'"),
    ({"presets": "tiny"}, "non-empty list"),
    ({"presets": ("tiny", "tiny")}, "preset 'tiny' is given twice"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"steps": -1}, "steps must be an integer >= 1"),
    ({"context_length": 256, "presets": ("tiny",)}, "context_length 256 is longer than "
                                                    "preset 'tiny'"),
    ({"repeats": 0}, "repeats must be an integer >= 1"),
    ({"warmup": -1}, "warmup must be an integer >= 0"),
    ({"max_seconds": float("nan")}, "max_seconds must be a number > 0"),
    ({"max_seconds": 0}, "max_seconds must be a number > 0"),
    ({"dtype": "float16"}, "dtype 'float16' is not supported"),
    ({"options": ("fp8",)}, "unknown part 'fp8'"),
    ({"options": ("bfloat16+float32",)}, "names two dtypes"),
    ({"options": ("default", "float32")}, "give each option set once"),
    ({"options": ()}, "non-empty list of option sets"),
    ({"vocab_size": 0}, "vocab_size must be an integer >= 1"),
])
def test_validate_rejects_bad_values_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        train.TrainBenchConfig(**fields).validate()
    assert "\n" not in str(info.value)


def test_a_bad_flag_is_one_line_on_stderr(tmp_path, capsys):
    code = cli.main(["bench", "train", "--presets", "tiny", "--context-length", "4096",
                     "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "context_length 4096" in err
    assert not (tmp_path / "train.json").exists()


def test_option_sets_and_device_defaults():
    parsed = train.OptionSet.parse("bfloat16+compile", "float32")
    assert (parsed.key, parsed.label) == ("bfloat16+compile", "bfloat16 autocast, torch.compile")
    assert train.OptionSet.parse("eager-attn", "bfloat16").key == "bfloat16+eager-attn"
    assert train.OptionSet.parse("default", "float32") == train.OptionSet("float32")
    cpu = train.TrainBenchConfig()
    assert [o.key for o in cpu.option_sets("float32", "cpu")] == [
        "float32", "bfloat16", "float32+compile", "float32+eager-attn"]
    assert [o.key for o in cpu.option_sets("bfloat16", "cuda")] == [
        "bfloat16", "bfloat16+compile"]
    plans = {p.preset: p for p in cpu.plan(CPU)}
    assert list(plans) == ["tiny", "mini", "gpt2-small"]
    assert all(p.context_length <= train.CPU_CONTEXT_CAP and p.steps >= 1
               for p in plans.values())
    # CUDA: nothing is allocated to plan, so it can be checked without a GPU.
    (gpu,) = cpu.plan(torch.device("cuda"))
    assert (gpu.preset, gpu.batch_size, gpu.context_length) == ("gpt2-small", 16, 1024)
    assert cpu.base_dtype(torch.device("cuda")) == "bfloat16"


def test_set_attention_backend_reaches_every_layer():
    model = GPTModel(GPTConfig.preset("tiny", vocab_size=50))
    assert train.set_attention_backend(model, "eager") == 2
    assert {b.att.backend for b in model.trf_blocks} == {"eager"}
    with pytest.raises(ValueError, match="must be one of"):
        train.set_attention_backend(model, "flash")


def test_a_failing_compile_is_reported_not_raised(tmp_path, monkeypatch):
    class Broken(nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("no C++ compiler found\nthe rest of a long traceback")

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: Broken())
    config = train.TrainBenchConfig.quick(options=("default", "compile"), repeats=1,
                                          device="cpu")
    report = train.run_train(config, tmp_path, log=lambda line: None)
    cases = report["results"]["tiny"]["cases"]
    assert cases["float32"]["status"] == "ok"
    failed = cases["float32+compile"]
    assert failed["status"] == "failed"
    assert failed["reason"] == "RuntimeError: no C++ compiler found"
    assert "failed" in train.table(report, "tiny")


def test_a_case_that_cannot_fit_is_skipped(monkeypatch):
    def refuse(*args, **kwargs):
        raise InsufficientMemoryError("training this GPT needs at least 9 GiB, but 1 GiB "
                                      "is available; choose a smaller --presets")

    monkeypatch.setattr(train, "check_training_memory", refuse)
    config = train.TrainBenchConfig.quick(device="cpu")
    plan = config.plan(CPU)[0]
    case = train.run_case(plan, train.OptionSet("float32"), config, CPU, [])
    assert case["status"] == "skipped" and "9 GiB" in case["reason"]


def test_the_time_budget_ends_the_timed_epochs():
    clock = iter([0.0, 1.0, 5.0, 9.0])
    data = train._EpochData(["a", "b"], warmup=1, max_seconds=10, clock=lambda: next(clock))
    g = torch.Generator()
    assert data(g) == ["a"]  # the warm-up epoch: one step
    assert data(g) == ["a", "b"]  # timed epoch 1 starts at 1
    assert data(g) == ["a", "b"]  # at 5: 4 s spent, 4 more would make 8 <= 10
    with pytest.raises(train._OutOfTimeError):  # at 9: 8 s spent, 4 more would make 12 > 10
        data(g)


def test_the_cuda_target_is_evaluated_on_cuda_only():
    def report(tps, context=1024):
        case = {"label": "bfloat16 autocast", "dtype": "bfloat16", "status": "ok",
                "tokens_per_sec": {"median": tps}, "mfu": {"median": 0.4}}
        return {"results": {"gpt2-small": {"context_length": context, "batch_size": 16,
                                           "cases": {"bfloat16": case}}}}

    cuda = torch.device("cuda")
    (met,) = train.targets(report(350_000.0), cuda)
    assert met["met"] and met["name"] == train.TARGET_NAME
    assert "350,000 tokens/s" in met["value_text"]
    (missed,) = train.targets(report(120_000.0), cuda)
    assert not missed["met"]
    assert train.targets(report(350_000.0), CPU) == []
    assert train.targets(report(350_000.0, context=512), cuda) == []


@pytest.mark.parametrize("tie_weights, qkv_bias", [(False, False), (True, True)])
def test_training_flops_per_token_matches_an_independent_count(tie_weights, qkv_bias):
    """6 N + 12 L T d against the matrix products a forward pass really runs, times 3
    (the backward pass multiplies twice as much: the gradients of the inputs and of the
    weights, each a product of the same size).

    Counted independently: every ``nn.Linear`` that executes, by a forward hook, as
    ``2 x in x out`` per token (a multiply and an add per weight); attention's two
    ``T x T x d_head`` products per head by PyTorch's FlopCounterMode. The attention
    layers run their eager backend here, whose products are plain ``bmm`` calls: the
    counter has no formula for the CPU's fused attention kernel and would count it as 0.
    The two counts agree exactly: both count only matrix products, and both count the
    full ``T x T`` scores although causal attention needs only their lower half (the
    usual MFU convention: work done, not work skipped). Biases, norms, GELU, softmax and
    the embedding look-ups are in neither, and a tied output head is counted as the
    product it still is.
    """
    cfg = GPTConfig(vocab_size=97, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0, tie_weights=tie_weights, qkv_bias=qkv_bias)
    model = GPTModel(cfg).eval()
    train.set_attention_backend(model, "eager")
    tokens = cfg.context_length
    linear_flops = []

    def count(module, inputs, output):
        rows = inputs[0].numel() // module.in_features
        linear_flops.append(2 * rows * module.in_features * module.out_features)

    hooks = [m.register_forward_hook(count) for m in model.modules()
             if isinstance(m, nn.Linear)]
    idx = torch.randint(0, cfg.vocab_size, (1, tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx)
    for hook in hooks:
        hook.remove()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = by_op["aten.bmm"]
    assert attention == 2 * cfg.n_layers * 2 * tokens * tokens * cfg.emb_dim
    assert len(linear_flops) == 6 * cfg.n_layers + 1  # q, k, v, out, 2 MLP; the head
    # The counter's matrix products are the hooks' linears plus attention.
    assert counter.get_total_flops() == sum(linear_flops) + attention
    forward = sum(linear_flops) + attention
    assert 3 * forward == pytest.approx(cfg.training_flops_per_token(tokens) * tokens,
                                        rel=1e-9)
