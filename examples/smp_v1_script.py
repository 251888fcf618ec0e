"""A training script in the shape of SMP v1's PyTorch documentation.

    torchrun --standalone --nproc_per_node=4 examples/smp_v1_script.py

Change the import line to `import smdistributed.modelparallel.torch as smp` and this is an SMP
v1 script; nothing else differs. It trains a small language model (plain PyTorch) on sequences
that count upwards, with 2 pipeline stages x 2-way tensor parallelism, shards the data by
dp_rank, evaluates, and saves a partial checkpoint on the rdp_rank() == 0 ranks.
"""

import argparse

import smp
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB, SEQ = 64, 32


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, dim=64, heads=4, layers=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CountingDataset(Dataset):
    """Sequences counting upwards (mod VOCAB) from a random start: learnable from context."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.data = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


@smp.step
def train_step(model, ids):
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    model.backward(loss)
    return loss


@smp.step
def test_step(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train(model, device, loader, optimizer, epoch):
    model.train()
    for batch_idx, ids in enumerate(loader):
        ids = ids.to(device)
        optimizer.zero_grad()
        loss_mb = train_step(model, ids)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        if smp.rank() == 0 and batch_idx % 5 == 0:
            print(f"Train epoch {epoch} batch {batch_idx}: loss {loss.item():.4f}", flush=True)


def test(model, device, loader):
    model.eval()
    total, batches = 0.0, 0
    with torch.no_grad():
        for ids in loader:
            total += test_step(model, ids.to(device)).reduce_mean().item()
            batches += 1
    return total / batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--save", default="")
    args = parser.parse_args()

    config = {
        "pipeline_parallel_degree": 2,
        "tensor_parallel_degree": 2,
        "microbatches": 4,
        "pipeline": "interleaved",
        "ddp": True,
    }
    smp.init(config)
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(42)  # the same initial model everywhere; smp seeds the tensor-parallel shards itself

    if smp.local_rank() == 0:  # one process per machine prepares the data, the others wait
        train_set, test_set = CountingDataset(640, seed=0), CountingDataset(128, seed=1)
        torch.save((train_set, test_set), "/tmp/smp_v1_script_data.pt")
    smp.barrier()
    train_set, test_set = torch.load("/tmp/smp_v1_script_data.pt", weights_only=False)

    # Each data-parallel rank reads its own shard, in the order its seed gives.
    sampler = DistributedSampler(train_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(), seed=42)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=False)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler, drop_last=True)

    with smp.tensor_parallelism():
        model = Net()
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3))

    if smp.rank() == 0:
        print(f"test loss before training {test(model, device, test_loader):.4f}", flush=True)
    else:
        test(model, device, test_loader)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        train(model, device, train_loader, optimizer, epoch)
        loss = test(model, device, test_loader)
        if smp.rank() == 0:
            print(f"Test epoch {epoch}: loss {loss:.4f}", flush=True)

    if args.save and smp.rdp_rank() == 0:  # not dp_rank: with tensor parallelism, one file per mp_rank
        smp.save({"model_state_dict": model.local_state_dict()}, args.save, partial=True)
    smp.barrier()
    if smp.rank() == 0:
        print(
            f"done: {args.epochs} epochs on {smp.size()} processes (pp={smp.pp_size()}, tp={smp.tp_size()})"
        )


if __name__ == "__main__":
    main()
