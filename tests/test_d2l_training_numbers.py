"""d2l-zh's Bahdanau training cell on qkv.d2l follows the book's random stream.

The chapter builds ``d2l.Seq2SeqEncoder``, its own attention decoder on
``d2l.AdditiveAttention``, and trains with ``d2l.load_data_nmt(64, 10)`` and
``d2l.train_seq2seq`` from seed 0. Every random number (weights, Xavier re-draws,
shuffling, dropout) is drawn in the book package's order, so the trained weights are the
book's. The reference below is d2l-zh 2.0.0's own package running the chapter's cells
on the same first 600 fra-eng pairs, CPU, one thread: the sum of the absolute values of
every trained parameter. Kernels of another CPU round differently in the last bits, so
the check allows 1e-7 relative; a different stream moves the sum by orders more.
"""

import pytest
import torch
from torch import nn

from qkv import d2l

# d2l-zh 2.0.0: the chapter's training cell from torch.manual_seed(0), num_epochs = 3,
# torch 2.13.0 CPU, 1 thread
BOOK_PARAMETER_SUM_3_EPOCHS = 14182.290429559907


class AttentionGRUDecoder(d2l.AttentionDecoder):
    """The chapter's decoder, in the order it builds and calls its layers: additive
    attention of the top hidden state over the encoder outputs, its context joined to
    the embedded token, a GRU step, then the output layer over all steps at once."""

    def __init__(self, vocab_size, embed_size, num_hiddens, num_layers, dropout):
        super().__init__()
        self.attention = d2l.AdditiveAttention(num_hiddens, num_hiddens, num_hiddens, dropout)
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size + num_hiddens, num_hiddens, num_layers, dropout=dropout)
        self.dense = nn.Linear(num_hiddens, vocab_size)

    def init_state(self, enc_outputs, enc_valid_lens, *args):
        outputs, hidden_state = enc_outputs
        return outputs.permute(1, 0, 2), hidden_state, enc_valid_lens

    def forward(self, X, state):
        enc_outputs, hidden_state, enc_valid_lens = state
        steps = []
        for x in self.embedding(X).permute(1, 0, 2):
            query = hidden_state[-1].unsqueeze(1)
            context = self.attention(query, enc_outputs, enc_outputs, enc_valid_lens)
            x = torch.cat((context, x.unsqueeze(1)), dim=-1)
            out, hidden_state = self.rnn(x.permute(1, 0, 2), hidden_state)
            steps.append(out)
        outputs = self.dense(torch.cat(steps, dim=0))
        return outputs.permute(1, 0, 2), [enc_outputs, hidden_state, enc_valid_lens]


def test_bahdanau_cell_trains_to_the_books_weights(shared_data, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # train_seq2seq saves its loss curve here, headless
    monkeypatch.setenv("QKV_FRA_ENG", str(shared_data / "fra-eng" / "fra.txt"))
    torch.manual_seed(0)
    embed_size, num_hiddens, num_layers, dropout = 32, 32, 2, 0.1
    train_iter, src_vocab, tgt_vocab = d2l.load_data_nmt(64, 10)
    encoder = d2l.Seq2SeqEncoder(len(src_vocab), embed_size, num_hiddens, num_layers, dropout)
    decoder = AttentionGRUDecoder(len(tgt_vocab), embed_size, num_hiddens, num_layers, dropout)
    net = d2l.EncoderDecoder(encoder, decoder)
    d2l.train_seq2seq(net, train_iter, 0.005, 3, tgt_vocab, "cpu")
    assert capsys.readouterr().out.startswith("loss ")
    total = sum(float(p.detach().double().abs().sum()) for p in net.parameters())
    assert total == pytest.approx(BOOK_PARAMETER_SUM_3_EPOCHS, rel=1e-7)
