#!/usr/bin/env python3
"""PyTorch baseline for the Transformer quality check (issue 14).

A byte-level language model built from torch.nn.TransformerEncoderLayer
(pre-LN, no dropout, causal mask) with PyTorch's default initialisation,
trained at the settings of configs/bench/kjv_transformer_quality.pbtxt and
scored the way `interlock train` scores a text model: mean cross-entropy over
the non-overlapping windows of the last 5 % of the corpus, perplexity = exp.

Training batches are drawn like ours (services/data_text.cc): the first 90 %
of the bytes cut into non-overlapping windows, shuffled each epoch;
--sampling random draws windows at uniformly random offsets instead.

  python3 tests/bench/transformer_ref.py --text .cache/data/kjv.txt
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.d_model
        self.tokens = nn.Embedding(256, d)
        self.positions = nn.Embedding(args.context, d)
        layer = nn.TransformerEncoderLayer(
            d, args.heads, dim_feedforward=args.d_ff, dropout=0.0,
            activation=args.activation, batch_first=True, norm_first=True)
        self.layers = nn.ModuleList(
            [self._clone(layer) for _ in range(args.layers)])
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 256)
        mask = torch.full((args.context, args.context), float('-inf'))
        self.register_buffer('mask', mask.triu(1))
        if args.init == 'normal':
            # Our NORMAL scheme: every weight and embedding N(0, 0.02), zero
            # biases, LayerNorms untouched.
            for name, p in self.named_parameters():
                if 'norm' in name or name.startswith('ln.'):
                    continue
                if p.dim() > 1:
                    nn.init.normal_(p, 0.0, 0.02)
                else:
                    nn.init.zeros_(p)

    @staticmethod
    def _clone(layer):
        # A fresh layer per depth, each with its own default initialisation.
        return type(layer)(
            layer.self_attn.embed_dim, layer.self_attn.num_heads,
            dim_feedforward=layer.linear1.out_features, dropout=0.0,
            activation=layer.activation, batch_first=True, norm_first=True)

    def forward(self, x):
        t = x.size(1)
        h = self.tokens(x) + self.positions(torch.arange(t)).unsqueeze(0)
        for layer in self.layers:
            h = layer(h, src_mask=self.mask[:t, :t])
        return self.fc(self.ln(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--text', default='.cache/data/kjv.txt')
    p.add_argument('--d-model', type=int, default=128)
    p.add_argument('--layers', type=int, default=8)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--d-ff', type=int, default=512)
    p.add_argument('--activation', default='relu', choices=['relu', 'gelu'])
    p.add_argument('--init', default='pytorch', choices=['pytorch', 'normal'])
    p.add_argument('--context', type=int, default=64)
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--steps', type=int, default=600)
    p.add_argument('--lr', type=float, default=1e-3)
    p.add_argument('--weight-decay', type=float, default=0.01)
    p.add_argument('--sampling', default='windows',
                   choices=['windows', 'random'])
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--out', help='write the result as JSON to this file')
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    data = torch.tensor(bytearray(open(args.text, 'rb').read()),
                        dtype=torch.long)
    n = data.numel()
    train, test = data[:n * 90 // 100], data[n * 95 // 100:]
    c = args.context

    def windows(stream):
        count = (stream.numel() - 1) // c
        x = stream[:count * c].view(count, c)
        y = stream[1:count * c + 1].view(count, c)
        return x, y

    train_x, train_y = windows(train)
    test_x, test_y = windows(test)
    model = Model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr,
                            weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    perm, cursor = torch.randperm(train_x.size(0), generator=gen), 0
    start = time.time()
    for step in range(args.steps):
        if args.sampling == 'random':
            off = torch.randint(0, train.numel() - c - 1, (args.batch,),
                                generator=gen)
            idx = off.unsqueeze(1) + torch.arange(c)
            x, y = train[idx], train[idx + 1]
        else:
            if cursor + args.batch > perm.numel():
                perm, cursor = torch.randperm(perm.numel(), generator=gen), 0
            sel = perm[cursor:cursor + args.batch]
            cursor += args.batch
            x, y = train_x[sel], train_y[sel]
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f'step {step} loss {loss.item():.4f} '
                  f'{time.time() - start:.0f} s', flush=True)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, test_x.size(0), 64):
            logits = model(test_x[i:i + 64])
            total += F.cross_entropy(logits.reshape(-1, 256),
                                     test_y[i:i + 64].reshape(-1),
                                     reduction='sum').item()
            count += test_y[i:i + 64].numel()
    result = dict(vars(args), test_loss=total / count,
                  test_perplexity=math.exp(total / count),
                  seconds=time.time() - start, torch=torch.__version__)
    print(json.dumps(result))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
