"""The main job: train a small GPT-style language model with pipeline parallelism on CPU processes.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py [--steps 30]

Written as an SMP v1 script: with `import smdistributed.modelparallel.torch as smp` in place of
`import smp` it is the same program. The model is plain PyTorch (torch's own
TransformerEncoderLayer, tied embedding and head); smp captures it, balances it over the
pipeline stages on the first step and trains it with the interleaved (1F1B) schedule. With 4
processes the 2 pipelines also train data-parallel.
"""

from __future__ import annotations

import argparse

import smp
import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, ids):
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def batches(vocab: int, seq: int, batch_size: int, seed: int):
    """Sequences that count upwards from a random start (mod vocab): learnable from context."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch_size, 1), generator=g)
        yield (start + torch.arange(seq)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel replica")
    args = parser.parse_args()

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved", "ddp": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(TinyLM())
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(ids):
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        model.backward(loss)
        return loss

    data = batches(128, 32, args.batch_size, seed=smp.dp_rank())
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = train_step(next(data)).reduce_mean()
        optimizer.step()
        if step == 0 and smp.rank() == 0:
            print(model.partition_report(), flush=True)
        if smp.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if smp.rank() == 0:
        print(f"done: {args.steps} steps on {smp.size()} processes (pp={smp.pp_size()}, dp={smp.dp_size()})")


if __name__ == "__main__":
    main()
