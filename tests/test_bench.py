"""Smoke tests of ``qkv bench``: every suite runs on tiny shapes and writes valid files.

No timing is asserted (this machine is shared and timings are noise at these sizes);
what is checked is that the reference implementations compute what qkv computes, that
the reports are complete, and that the command line reaches every suite.
"""

import argparse
import json

import pytest
import torch

from qkv.bench import attention, data, lm, timing, translate
from qkv.cli import bench as bench_cli
from qkv.tasks.translate import translation_loss

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_report(path):
    report = json.loads(path.read_text())
    assert report["machine"]["torch"] == torch.__version__
    return report


def assert_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(path).shape[0] > 50  # decodes, and is a real picture


def tiny_attention(**overrides):
    return attention.AttentionConfig(
        **{"batch": 2, "tokens": 16, "dim": 32, "heads": 4, "repeats": 1, "warmup": 0,
           "memory": "in-process", "compile_flex": False, "device": "cpu",
           "sweep_tokens": (8, 16), "sweep_repeats": 1, **overrides}
    )


# ----------------------------------------------------------------------------
# timing


def test_round_robin_interleaves_and_summarises():
    order = []
    cases = {name: (lambda name=name: order.append(name)) for name in "abc"}
    stats = timing.round_robin(cases, repeats=3, warmup=1, device=torch.device("cpu"))
    assert order[:3] == list("abc")  # warm-up
    assert order[3:] == list("abc") + list("bca") + list("cab")  # rotating rounds
    s = stats["a"]
    assert len(s.samples) == 3 and s.min <= s.median <= s.max


def test_round_robin_with_a_count_per_case():
    order = []
    cases = {name: (lambda name=name: order.append(name)) for name in "abc"}
    stats = timing.round_robin(cases, repeats={"a": 3, "b": 1, "c": 2}, warmup=0,
                               device=torch.device("cpu"))
    assert order == list("abc") + list("ca") + list("a")  # b sits out rounds 2 and 3
    assert [len(stats[n].samples) for n in "abc"] == [3, 1, 2]
    with pytest.raises(ValueError, match="name every case"):
        timing.round_robin(cases, repeats={"a": 1}, warmup=0, device=torch.device("cpu"))


def test_cpu_peak_bytes_sees_a_large_allocation():
    # 128 MiB: more than glibc keeps free at the top of its heap (at most twice its 32 MiB
    # mmap threshold), so the pages are new whatever earlier tests freed, not reused
    nbytes, method = timing.cpu_peak_bytes(lambda: torch.ones(128 * 2**20 // 4).sum())
    assert method in ("vmhwm", "ru_maxrss")
    if method == "vmhwm":
        assert nbytes >= 120 * 2**20


def test_markdown_table_aligns_columns():
    text = timing.markdown_table(["a", "bb"], [["x", "1"], ["long", "22"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].endswith(":|")  # numbers right-aligned


# ----------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("name", list(attention.PATHS))
def test_every_attention_path_matches_qkv(name):
    diffs = attention.check_agreement((name,), 32, 4, torch.device("cpu"), compile_flex=False)
    assert diffs[name] < 1e-5


def test_agreement_check_catches_a_broken_path(monkeypatch):
    def broken(self, x):
        return x * 0.5  # differentiable, and wrong

    monkeypatch.setattr(attention.BookMHA, "forward", broken)
    with pytest.raises(RuntimeError, match="book-mha"):
        attention.check_agreement(("book-mha",), 32, 4, torch.device("cpu"))


def test_attention_suite_writes_json_and_pngs(tmp_path):
    report = attention.run_attention(tiny_attention(sweep=True), tmp_path, log=lambda s: None)
    saved = read_report(tmp_path / "attention.json")
    assert saved["results"].keys() == report["results"].keys() == set(attention.TABLE_PATHS)
    for name, entry in saved["results"].items():
        assert entry["forward"]["seconds"]["median"] > 0
        assert "peak_bytes" in entry["forward"]
        assert ("train" in entry) == (name != "flex")
    assert saved["results"]["book-mha"]["train"]["speedup_vs_book-mha"] == 1.0
    assert {p["tokens"] for p in saved["sweep"]["paths"]["qkv"]} == {8, 16}
    names = {t["name"] for t in saved["targets"]}
    assert any("2x faster than book MHA" in n for n in names)
    assert any("1/4 of the eager path" in n for n in names)
    assert_png(tmp_path / "attention.png")
    assert_png(tmp_path / "attention-sweep.png")


def test_attention_memory_in_a_fresh_process():
    result = timing.run_isolated(attention.measure_memory, name="qkv", mode="train", batch=1,
                                 tokens=16, dim=32, heads=4, device="cpu", dtype="float32")
    assert result["bytes"] >= 0 and result["method"] in ("vmhwm", "ru_maxrss")


def test_isolated_failure_is_one_readable_error():
    with pytest.raises(RuntimeError, match="unknown attention path"):
        timing.run_isolated(attention.measure_memory, name="nope", mode="forward", batch=1,
                            tokens=8, dim=8, heads=2, device="cpu", dtype="float32")


# ----------------------------------------------------------------------------
# generate


def test_generate_suite_cached_and_uncached_tokens_identical(tmp_path):
    from qkv.models.gpt import GPTConfig, GPTModel

    config = lm.GenerateConfig.quick(new_tokens=12, repeats=1, device="cpu", bandwidth_mib=16)
    report = lm.run_generate(config, tmp_path, log=lambda s: None)
    # The two paths' float32 logits differ by ~1e-6 here. Identical tokens are a real
    # promise only where no greedy choice is that close to a tie: check that first, so
    # that a failure says which of the two it is.
    torch.manual_seed(config.seed)
    model = GPTModel(GPTConfig.preset(config.preset)).eval()
    tokens = torch.tensor([list(config.prompt) + report["tokens"][0]])
    with torch.no_grad():
        logits = model(tokens)[0, len(config.prompt) - 1 : -1]  # behind each new token
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-5  # 3.5e-4 on this data
    assert report["identical_tokens"] and report["first_difference"] is None
    assert report["first_difference_margin"] is None
    saved = read_report(tmp_path / "generate.json")
    assert len(saved["tokens"][0]) == 12 and len(saved["low_tokens"][0]) == 12
    assert set(saved["results"]) == {"cached", "uncached", "low-cached"}
    assert saved["results"]["cached"]["tokens_per_sec"]["median"] > 0
    # the ceiling: bandwidth over the bytes of each dtype, and the percentage of it
    bw = saved["bandwidth_bytes_per_sec"]["median"]
    for name in ("float32", "bfloat16"):
        ceiling = saved["ceiling_tokens_per_sec"][name]
        assert ceiling == pytest.approx(bw / saved["bytes_per_token"][name]["total"])
    cached = saved["results"]["cached"]
    assert cached["percent_of_ceiling"] == pytest.approx(
        100 * cached["tokens_per_sec"]["median"] / saved["ceiling_tokens_per_sec"]["float32"])
    assert saved["low_uncached_check"]["checked"]
    assert [t["threshold"] for t in saved["targets"]] == [6.0, 1.0, 0.8, 1.6]
    assert_png(tmp_path / "generate.png")


@pytest.mark.parametrize("tie_weights", [False, True])
def test_decode_bytes_per_token_counts_each_parameter_once(tie_weights):
    from qkv.models.gpt import GPTConfig, GPTModel

    cfg = GPTConfig.preset("tiny", vocab_size=300, tie_weights=tie_weights)
    model = GPTModel(cfg)
    d, L, C, V = cfg.emb_dim, cfg.n_layers, cfg.context_length, cfg.vocab_size
    # from the config alone: all parameters but the rows no lookup reads
    unread = (C - 1) * d + (0 if tie_weights else (V - 1) * d)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        counted = lm.decode_bytes_per_token(model.to(dtype), prompt_len=4, new_tokens=10)
        assert counted["weights"] == (cfg.num_parameters() - unread) * size
        # steps attend to 4, 5, ..., 13 positions: 8.5 on average, keys and values
        assert counted["kv_positions"] == 8.5
        assert counted["kv_cache"] == L * 2 * d * 8.5 * size
        assert counted["total"] == counted["weights"] + counted["kv_cache"]
    # past the context the cache holds context_length positions
    assert lm.decode_bytes_per_token(model, 1, C + 50)["kv_positions"] < C
    batch = lm.decode_bytes_per_token(model, 4, 10, batch=4)
    assert batch["total"] == batch["weights"] / 4 + batch["kv_cache"]


def test_uncached_choices_are_the_greedy_tokens_without_a_cache():
    from qkv.models.gpt import GPTConfig, GPTModel, generate

    torch.manual_seed(0)
    model = GPTModel(GPTConfig.preset("tiny", vocab_size=97)).eval()
    idx = torch.tensor([[5, 6, 7]])
    out = generate(model, idx, 9, use_cache=False)
    assert torch.equal(lm.uncached_choices(model, out, 3), out[:, 3:])


def test_first_difference():
    a = torch.tensor([[1, 2, 3, 4]])
    assert lm.first_difference(a, a.clone()) is None
    assert lm.first_difference(a, torch.tensor([[1, 2, 9, 4]])) == 2


def test_top2_margin_reads_the_logits_behind_one_choice():
    seen = []

    class Fixed(torch.nn.Module):
        def forward(self, ids):  # (batch, T) -> (batch, T, 4); row 1 has the closer call
            seen.append(ids.shape[1])
            rows = torch.tensor([[0.0, 3.0, 2.5, 1.0], [0.0, 2.0, 1.75, 1.0]])
            return rows[:, None, :].expand(ids.shape[0], ids.shape[1], 4)

    tokens = torch.zeros(2, 10, dtype=torch.long)
    assert lm.top2_margin(Fixed(), tokens, 7, context=4) == 0.25
    assert seen == [4]  # the last `context` tokens before position 7
    assert lm.top2_margin(Fixed(), tokens, 3, context=4) == 0.25
    assert seen == [4, 3]
    with pytest.raises(ValueError, match=r"position must be in \[1, 10\], got 0"):
        lm.top2_margin(Fixed(), tokens, 0, context=4)


# ----------------------------------------------------------------------------
# translate


@pytest.fixture(scope="module")
def small_translation():
    from qkv.data.translate import BOS
    from qkv.models.build import build_model
    from qkv.tasks.translate import prepare_data

    config = translate.TranslateBenchConfig.quick(num_examples=200, dropout=0.0, device="cpu")
    settings = config.settings()
    torch.manual_seed(0)
    data_ = prepare_data(settings)
    model = build_model(settings.model_config(data_.src_vocab, data_.tgt_vocab))
    return model, data_, data_.tgt_vocab[BOS]


def test_d2l_reference_computes_the_same_loss(small_translation):
    model, data_, bos = small_translation
    reference = translate.D2LSeq2Seq(model.config)
    batch = tuple(t[:16] for t in data_.train)
    ours, ref = translate.compare_losses(model, reference, batch, bos)
    # Same weights, two implementations (fused GRU kernel vs d2l's steps): equal to float32
    # rounding of a mean over the batch's tokens (1 ulp apart here), not bit for bit.
    assert ours == pytest.approx(ref, rel=1e-5)


def test_d2l_reference_gradients_match(small_translation):
    from qkv.models.seq2seq import teacher_forcing_input

    model, data_, bos = small_translation
    reference = translate.D2LSeq2Seq(model.config)
    reference.load_state_dict(model.state_dict())
    src, src_len, tgt, tgt_len = (t[:16] for t in data_.train)
    model.zero_grad()
    loss_sum, tokens = translation_loss(bos)(model, (src, src_len, tgt, tgt_len))
    (loss_sum / tokens).backward()
    translate.d2l_loss(reference(src, teacher_forcing_input(tgt, bos), src_len), tgt,
                       tgt_len).backward()
    ours = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(p.grad, ours[name].grad, rtol=1e-4, atol=1e-6)


def test_d2l_masked_softmax_and_clipping():
    x = torch.zeros(2, 1, 4)
    w = translate.d2l_masked_softmax(x.clone(), torch.tensor([1, 3]))
    torch.testing.assert_close(w[0, 0], torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(w[1, 0, :3], torch.full((3,), 1 / 3))
    layer = torch.nn.Linear(2, 2)
    for p in layer.parameters():
        p.grad = torch.full_like(p, 10.0)
    translate.d2l_grad_clipping(layer, 1.0)
    norm = torch.sqrt(sum((p.grad**2).sum() for p in layer.parameters()))
    assert norm.item() == pytest.approx(1.0, rel=1e-5)


def test_translate_suite_writes_json_and_png(tmp_path):
    config = translate.TranslateBenchConfig.quick(num_examples=200, repeats=1, warmup=0,
                                                  device="cpu")
    report = translate.run_translate(config, tmp_path, log=lambda s: None)
    saved = read_report(tmp_path / "translate.json")
    assert saved["initial_loss"]["qkv"] == pytest.approx(saved["initial_loss"]["d2l"], rel=1e-5)
    assert saved["speedup"] == pytest.approx(report["speedup"])
    assert saved["results"]["qkv"]["tokens_per_sec"]["median"] > 0
    assert_png(tmp_path / "translate.png")


# ----------------------------------------------------------------------------
# data


def test_list_of_tensors_dataset_gives_the_same_windows():
    from qkv.data.lm import GPTDataset

    ids = data.make_ids(300, vocab_size=50, seed=1)
    ours, theirs = GPTDataset(ids, 16, 3), data.ListOfTensorsDataset(ids, 16, 3)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        for a, b in zip(ours[i], theirs[i], strict=True):
            assert torch.equal(a, b)


def test_data_suite_writes_json_and_png(tmp_path):
    config = data.DataBenchConfig(num_tokens=3000, max_length=32, repeats=1,
                                  memory="in-process")
    data.run_data(config, tmp_path, log=lambda s: None)
    saved = read_report(tmp_path / "data.json")
    assert saved["results"]["qkv"]["windows"] == saved["results"]["list"]["windows"] == 2968
    assert saved["targets"][0]["name"].startswith("dataset memory")
    assert_png(tmp_path / "data.png")


# ----------------------------------------------------------------------------
# command line


def parse(argv):
    """The bench sub-command on a parser of its own (``qkv.cli.main`` knows only the
    commands registered in ``qkv/cli/__init__.py``)."""
    parser = argparse.ArgumentParser(prog="qkv")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_flags_reach_the_configs(tmp_path):
    args = parse(["bench", "attention", "--quick", "--repeats", "2", "--warmup", "0",
                  "--memory", "off", "--sweep", "--no-compile", "--out", str(tmp_path)])
    assert (args.suite, args.repeats, args.warmup, args.sweep, args.no_compile) == (
        "attention", 2, 0, True, True)
    assert args.out == tmp_path and args.run is bench_cli.run


def test_no_native_reaches_the_generate_config(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(lm, "run_generate", lambda config, out: seen.append(config) or {})
    for argv, native in ((["--no-native"], False), ([], None)):
        args = parse(["bench", "generate", "--quick", *argv, "--out", str(tmp_path)])
        bench_cli.run_suite("generate", args)
        assert seen[-1].native is native and seen[-1].preset == "tiny"


@pytest.mark.parametrize("suite", ["data", "generate", "translate", "save"])
def test_cli_runs_each_quick_suite(suite, tmp_path, capsys):
    args = parse(["bench", suite, "--quick", "--repeats", "1", "--warmup", "0",
                  "--memory", "in-process", "--device", "cpu", "--out", str(tmp_path)])
    assert args.run(args) == 0
    assert "| " in capsys.readouterr().out  # a table was printed
    assert (tmp_path / f"{suite}.json").is_file() and (tmp_path / f"{suite}.png").is_file()


def test_cli_runs_the_attention_suite(tmp_path, monkeypatch):
    # The quick shapes, shrunk further so that this stays a smoke test.
    quick = attention.AttentionConfig.quick

    def tiny(**overrides):
        return quick(**{**overrides, "tokens": 16, "dim": 32, "sweep_tokens": (8, 16)})

    monkeypatch.setattr(attention.AttentionConfig, "quick", staticmethod(tiny))
    args = parse(["bench", "attention", "--quick", "--repeats", "1", "--warmup", "0",
                  "--memory", "off", "--no-compile", "--sweep", "--device", "cpu",
                  "--out", str(tmp_path)])
    assert args.run(args) == 0
    report = read_report(tmp_path / "attention.json")
    assert report["config"]["compile_flex"] is False and "sweep" in report


def test_cli_rejects_bad_numbers(tmp_path):
    args = parse(["bench", "data", "--repeats", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--repeats must be an integer in \[1, 10,000\], got 0"):
        args.run(args)
    args = parse(["bench", "translate", "--dtype", "bfloat16", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="float32"):
        args.run(args)


def test_save_suite_measures_the_whole_checkpoint(tmp_path):
    from qkv.bench.save import SaveBenchConfig, run_save
    from qkv.models.gpt import GPTConfig

    report = run_save(SaveBenchConfig.quick(repeats=1), tmp_path, log=lambda line: None)
    tiny = report["results"]["tiny"]
    # float32 weights and AdamW's two moments: 12 bytes a parameter, and a little more.
    params = GPTConfig.preset("tiny", context_length=8).num_parameters()
    assert tiny["parameters"] == params
    assert 12 * params <= tiny["bytes"] < 12 * params + (1 << 20)
    assert tiny["cost_fraction"] == pytest.approx(tiny["seconds"]["median"] / 600)
    assert not (tmp_path / "save-bench-runs").exists()  # the checkpoints are removed


def test_gguf_suite_imports_a_file_of_each_type(tmp_path, capsys):
    pytest.importorskip("gguf")
    args = parse(["bench", "gguf", "--quick", "--types", "Q5_0", "IQ4_NL", "--repeats", "1",
                  "--warmup", "0", "--out", str(tmp_path)])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "| Q5_0 " in out and "| IQ4_NL " in out
    report = read_report(tmp_path / "gguf.json")
    results = report["results"]
    assert [results[t]["decoder"] for t in ("Q5_0", "IQ4_NL")] == ["qkv", "gguf"]
    # The quick Llama: 512 x 256 tied embedding, 2 layers of q, o (256 x 256), k, v
    # (256 x 256: 4 KV heads of 64), gate, up, down (512 x 256) and 2 norms, a final norm.
    layer = 4 * 256 * 256 + 3 * 512 * 256 + 2 * 256
    assert results["Q5_0"]["parameters"] == 512 * 256 + 2 * layer + 256
    # Q5_0 is 22 bytes a block of 32 values, IQ4_NL 18, the norms 4 bytes a value
    matrices = 512 * 256 + 2 * (layer - 2 * 256)
    assert results["Q5_0"]["file_bytes"] > matrices // 32 * 22
    assert results["IQ4_NL"]["file_bytes"] < results["Q5_0"]["file_bytes"]
    assert "speedup_over_gguf" in results["Q5_0"] and "speedup_over_gguf" not in results["IQ4_NL"]
    assert not (tmp_path / "gguf-bench-files").exists()
    args = parse(["bench", "gguf", "--types", "Q9_9", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"type 'Q9_9' is not read; choose from F32, F16"):
        args.run(args)
