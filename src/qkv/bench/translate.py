"""``qkv bench translate``: training speed of qkv's Bahdanau translator against d2l's algorithm.

Ours is what ``qkv translate train`` runs: :class:`qkv.models.BahdanauSeq2Seq` trained by
:class:`qkv.training.Trainer` (Adam, gradient clipping, per-token masked cross-entropy).

The reference, :class:`D2LSeq2Seq`, is written here to follow d2l §11.4's algorithm step
for step, the way its ``train_seq2seq`` runs it:

- the encoder is an embedding and a GRU, read time-major;
- at every decoder step, additive attention projects the *queries and the keys*
  (``W_q`` and ``W_k``), masks with d2l's ``masked_softmax`` (``repeat_interleave`` of the
  valid lengths, ``X[~mask] = -1e6`` in place), then ``bmm`` with the values;
- ``[context, embedding]`` goes through the GRU one step at a time;
- gradients are clipped by d2l's ``grad_clipping`` (global norm, scaled in place).

The one deliberate difference from d2l is the loss: both sides use the per-valid-token
mean, so that they optimise the same objective and
:func:`compare_losses` can check, on one batch and with the same weights, that the
reference computes exactly what qkv's model computes.

Both train on the same batches (the ``dates`` corpus, the seeded shuffle of each epoch),
with the same hyperparameters (qkv's ``translate`` defaults), from the same initial
weights. Throughput is target tokens (``<eos>`` included, padding excluded) per second
of wall time per epoch, data loading included, as the trainer reports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.translate import BOS
from ..models.build import build_model
from ..models.seq2seq import Seq2SeqConfig, teacher_forcing_input
from ..tasks.translate import TranslateSettings, prepare_data, translation_loss
from ..training import (
    TrainConfig,
    Trainer,
    epoch_seed,
    seed_everything,
)
from ..utils.figures import new_figure, save_figure
from .timing import (
    hbars,
    machine_info,
    markdown_table,
    resolve_device,
    round_robin,
    target_line,
    write_json,
)

__all__ = [
    "D2LSeq2Seq",
    "TranslateBenchConfig",
    "compare_losses",
    "d2l_grad_clipping",
    "d2l_masked_softmax",
    "run_translate",
]

PATHS = {"qkv": "qkv BahdanauSeq2Seq + Trainer", "d2l": "d2l algorithm (reference)"}


# ----------------------------------------------------------------------------
# The reference, d2l's algorithm


def d2l_masked_softmax(X: Tensor, valid_lens: Tensor | None) -> Tensor:
    """d2l's ``masked_softmax``: scores past each valid length set to ``-1e6`` in place.

    ``X (batch, queries, keys)``, ``valid_lens (batch,)`` or ``(batch, queries)``.
    """
    if valid_lens is None:
        return torch.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    flat = X.reshape(-1, shape[-1])
    keep = torch.arange(shape[-1], device=X.device)[None, :] < valid_lens[:, None]
    flat[~keep] = -1e6
    return torch.softmax(flat.reshape(shape), dim=-1)


class D2LAdditiveAttention(nn.Module):
    """d2l's ``AdditiveAttention``: keys and queries are both projected on every call."""

    def __init__(self, num_hiddens: int, dropout: float) -> None:
        super().__init__()
        self.W_k = nn.Linear(num_hiddens, num_hiddens, bias=False)
        self.W_q = nn.Linear(num_hiddens, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor) -> Tensor:
        queries, keys = self.W_q(queries), self.W_k(keys)
        # (batch, queries, 1, h) + (batch, 1, keys, h), summed by broadcasting
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = d2l_masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class D2LEncoder(nn.Module):
    """Embedding then GRU; ``X (batch, steps) -> (outputs (steps, batch, h), state)``."""

    def __init__(self, c: Seq2SeqConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c.src_vocab_size, c.embed_size)
        self.rnn = nn.GRU(c.embed_size, c.num_hiddens, c.num_layers, dropout=c.dropout)

    def forward(self, X: Tensor) -> tuple[Tensor, Tensor]:
        return self.rnn(self.embedding(X.t().type(torch.int64)))


class D2LDecoder(nn.Module):
    """d2l's ``Seq2SeqAttentionDecoder``: attention, concatenation and GRU, step by step."""

    def __init__(self, c: Seq2SeqConfig) -> None:
        super().__init__()
        self.attention = D2LAdditiveAttention(c.num_hiddens, c.dropout)
        self.embedding = nn.Embedding(c.tgt_vocab_size, c.embed_size)
        self.rnn = nn.GRU(c.embed_size + c.num_hiddens, c.num_hiddens, c.num_layers,
                          dropout=c.dropout)
        self.dense = nn.Linear(c.num_hiddens, c.tgt_vocab_size)

    def init_state(self, enc_outputs: tuple[Tensor, Tensor], enc_valid_lens: Tensor) -> list:
        outputs, hidden_state = enc_outputs
        return [outputs.permute(1, 0, 2), hidden_state, enc_valid_lens]

    def forward(self, X: Tensor, state: list) -> tuple[Tensor, list]:
        enc_outputs, hidden_state, enc_valid_lens = state
        X = self.embedding(X).permute(1, 0, 2)  # (steps, batch, embed)
        outputs = []
        for x in X:
            query = hidden_state[-1].unsqueeze(1)  # (batch, 1, h)
            context = self.attention(query, enc_outputs, enc_outputs, enc_valid_lens)
            x = torch.cat((context, x.unsqueeze(1)), dim=-1)
            out, hidden_state = self.rnn(x.permute(1, 0, 2), hidden_state)
            outputs.append(out)
        outputs = self.dense(torch.cat(outputs, dim=0))
        return outputs.permute(1, 0, 2), [enc_outputs, hidden_state, enc_valid_lens]


class D2LSeq2Seq(nn.Module):
    """d2l's ``EncoderDecoder`` with the parameter names of :class:`BahdanauSeq2Seq`, so
    ``load_state_dict(qkv_model.state_dict())`` gives both the same weights.

    ``forward(enc_X (b, S), dec_X (b, T), enc_valid_lens (b,)) -> logits (b, T, vocab)``
    (d2l's argument order).
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.encoder = D2LEncoder(config)
        self.decoder = D2LDecoder(config)

    def forward(self, enc_X: Tensor, dec_X: Tensor, enc_valid_lens: Tensor) -> Tensor:
        state = self.decoder.init_state(self.encoder(enc_X), enc_valid_lens)
        return self.decoder(dec_X, state)[0]


def d2l_loss(pred: Tensor, label: Tensor, valid_len: Tensor) -> Tensor:
    """d2l's ``MaskedSoftmaxCELoss`` recipe (unreduced cross-entropy times a 0/1 mask),
    normalised per valid token as qkv does (d2l divides by ``num_steps`` per sequence)."""
    weights = (torch.arange(label.shape[1], device=label.device)[None, :]
               < valid_len[:, None]).float()
    unweighted = F.cross_entropy(pred.permute(0, 2, 1), label, reduction="none")
    return (unweighted * weights).sum() / weights.sum()


def d2l_grad_clipping(net: nn.Module, theta: float) -> None:
    """d2l's ``grad_clipping``: scale all gradients in place when their norm exceeds theta."""
    params = [p for p in net.parameters() if p.requires_grad and p.grad is not None]
    norm = torch.sqrt(sum(torch.sum(p.grad**2) for p in params))
    if norm > theta:
        for p in params:
            p.grad[:] *= theta / norm


def d2l_train_epoch(
    net: D2LSeq2Seq, optimizer: torch.optim.Optimizer, batches: Any, bos_id: int,
    clip_norm: float, device: torch.device,
) -> None:
    """One epoch of d2l's ``train_seq2seq`` inner loop."""
    net.train()
    for batch in batches:
        optimizer.zero_grad()
        X, X_valid_len, Y, Y_valid_len = [x.to(device) for x in batch]
        bos = torch.tensor([bos_id] * Y.shape[0], device=device).reshape(-1, 1)
        dec_input = torch.cat([bos, Y[:, :-1]], 1)  # teacher forcing
        Y_hat = net(X, dec_input, X_valid_len)
        loss = d2l_loss(Y_hat, Y, Y_valid_len)
        loss.backward()
        d2l_grad_clipping(net, clip_norm)
        optimizer.step()


# ----------------------------------------------------------------------------
# Checking the reference


def compare_losses(
    model: nn.Module, reference: D2LSeq2Seq, batch: tuple[Tensor, ...], bos_id: int,
) -> tuple[float, float]:
    """Per-token loss of qkv's model and of the reference on one batch, dropout off.

    Copies the model's weights into the reference first. Equal numbers (to float
    rounding) mean the reference computes the same function by d2l's steps.
    """
    reference.load_state_dict(model.state_dict())
    was_training = model.training
    model.eval()
    reference.eval()
    try:
        with torch.no_grad():
            loss_sum, tokens = translation_loss(bos_id)(model, batch)
            src, src_valid_len, tgt, tgt_valid_len = batch
            ref = d2l_loss(reference(src, teacher_forcing_input(tgt, bos_id), src_valid_len),
                           tgt, tgt_valid_len)
    finally:
        model.train(was_training)
    return (loss_sum / tokens).item(), ref.item()


# ----------------------------------------------------------------------------
# The suite


@dataclass
class TranslateBenchConfig:
    """What to train: qkv's ``translate train`` defaults on the ``dates`` corpus.

    One timed call is one epoch over the training split; ``warmup`` untimed epochs run
    first. The remaining fields are :class:`qkv.tasks.translate.TranslateSettings`'.
    """

    num_examples: int = 10_000
    batch_size: int = 64
    embed_size: int = 32
    num_hiddens: int = 32
    num_layers: int = 2
    dropout: float = 0.1
    lr: float = 0.005
    clip_norm: float = 1.0
    seed: int = 0
    repeats: int = 3
    warmup: int = 1
    device: str = "auto"

    @classmethod
    def quick(cls, **overrides: Any) -> TranslateBenchConfig:
        """1,000 pairs: each epoch takes a fraction of a second."""
        return cls(**{"num_examples": 1000, **overrides})

    def settings(self) -> TranslateSettings:
        return TranslateSettings(
            data="dates", model="bahdanau", num_examples=self.num_examples,
            embed_size=self.embed_size, num_hiddens=self.num_hiddens,
            num_layers=self.num_layers, dropout=self.dropout, batch_size=self.batch_size,
            lr=self.lr, clip_norm=self.clip_norm, seed=self.seed, device=self.device,
        ).resolved()

    def validate(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, "
                             f"{self.warmup}")


def run_translate(
    config: TranslateBenchConfig, out_dir: str | Path, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train both for ``warmup + repeats`` epochs each, interleaved; print the table,
    write ``translate.json`` and ``translate.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    machine = machine_info(device)  # recorded when the run starts
    settings = config.settings()
    seed_everything(settings.seed)
    data = prepare_data(settings)
    bos_id = data.tgt_vocab[BOS]
    model = build_model(settings.model_config(data.src_vocab, data.tgt_vocab)).to(device)
    reference = D2LSeq2Seq(model.config).to(device)

    # Same weights, same batch: the reference must compute the same loss.
    first = tuple(t[: settings.batch_size].to(device) for t in data.train)
    ours_loss, ref_loss = compare_losses(model, reference, first, bos_id)
    if abs(ours_loss - ref_loss) > 1e-4 * max(1.0, abs(ours_loss)):
        raise RuntimeError(f"the d2l reference computes loss {ref_loss:.6f} where qkv's model "
                           f"computes {ours_loss:.6f}; the comparison would be meaningless")
    tokens_per_epoch = int(data.train[3].sum())
    log(f"translate: dates, {len(data.train[0]):,} training pairs ({tokens_per_epoch:,} target "
        f"tokens per epoch), batch {settings.batch_size}, {settings.num_layers}-layer GRUs of "
        f"{settings.num_hiddens}, on {device}, {torch.get_num_threads()} threads; "
        f"both start from the same weights (loss {ours_loss:.4f} = {ref_loss:.4f})")

    trainer = Trainer(
        model, translation_loss(bos_id),
        lambda g: data.train_loader(settings.batch_size, generator=g),
        TrainConfig(epochs=0, lr=settings.lr, clip_norm=settings.clip_norm,
                    device=str(device), seed=settings.seed, log_every=0, progress=False),
        log=lambda line: None,
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=settings.lr)
    ref_epochs = 0

    def train_ours() -> None:
        trainer.config.epochs += 1
        trainer.fit()

    def train_reference() -> None:
        nonlocal ref_epochs
        g = torch.Generator().manual_seed(epoch_seed(settings.seed, ref_epochs))
        d2l_train_epoch(reference, ref_optimizer, data.train_loader(settings.batch_size,
                        generator=g), bos_id, settings.clip_norm, device)
        ref_epochs += 1

    log(f"timing: {len(PATHS)} paths x {config.repeats} epochs (+{config.warmup} warm-up)")
    stats = round_robin({"qkv": train_ours, "d2l": train_reference}, repeats=config.repeats,
                        warmup=config.warmup, device=device, progress=log)
    results = {}
    for name in PATHS:
        s = stats[name]
        results[name] = {
            "seconds_per_epoch": s.to_dict(),
            "tokens_per_sec": {"median": tokens_per_epoch / s.median,
                               "min": tokens_per_epoch / s.max,
                               "max": tokens_per_epoch / s.min},
        }
    speedup = stats["d2l"].median / stats["qkv"].median
    report: dict[str, Any] = {
        "suite": "translate",
        "config": dataclasses.asdict(config),
        "settings": dataclasses.asdict(settings),
        "machine": machine,
        "tokens_per_epoch": tokens_per_epoch,
        "initial_loss": {"qkv": ours_loss, "d2l": ref_loss},
        "final_train_loss_qkv": trainer.history["loss"][-1],
        "results": results,
        "speedup": speedup,
        "targets": [{"name": "translator training >= 2x the d2l-algorithm tokens/s",
                     "value": speedup, "threshold": 2.0, "met": speedup >= 2.0,
                     "value_text": f"{speedup:.2f}x"}],
    }
    log(f"\ntraining throughput, {tokens_per_epoch:,} target tokens per epoch:\n")
    log(table(report))
    log("")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "translate.json", report)
    plot(report, out_dir / "translate.png")
    log(f"\nwrote {out_dir / 'translate.json'} and {out_dir / 'translate.png'}")
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    base = report["results"]["d2l"]["tokens_per_sec"]["median"]
    for name, label in PATHS.items():
        r = report["results"][name]
        s, tps = r["seconds_per_epoch"], r["tokens_per_sec"]
        rows.append([label, f"{s['median']:.3g}", f"{s['min']:.3g}-{s['max']:.3g}",
                     f"{tps['median']:,.0f}", f"{tps['min']:,.0f}-{tps['max']:,.0f}",
                     f"{tps['median'] / base:.2f}x"])
    header = ["path", "s/epoch", "min-max s", "tokens/s", "min-max tokens/s", "x d2l"]
    return markdown_table(header, rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Training tokens per second of both, whiskers min-max."""
    fig = new_figure(8, 2.8)
    ax = fig.add_subplot()
    hbars(ax, list(PATHS.values()), [report["results"][n]["tokens_per_sec"] for n in PATHS],
          colors=["tab:orange", "tab:blue"],
          xlabel="training tokens per second (median, whiskers min-max)")
    ax.set_title(f"Bahdanau translator training: {report['speedup']:.2f}x d2l's algorithm",
                 fontsize=10)
    return save_figure(fig, path)
