"""An MNIST-style SMP v1 script, in the patterns of AWS's SMP MNIST examples and its
deep-learning-containers CI test, with only the import being smp's (here the alias package,
so not even that line changes): the optimizer is built before wrapping, smp.amp.GradScaler,
list outputs from an evaluation step (`sum(losses)`), smp.allgather of the test loss across
data-parallel ranks, partial and full saves, and loading before the first step in a new run.

The data are synthetic 8x8 "digits" (a class-dependent pattern plus noise), so it needs no
download. Run: torchrun --standalone --nproc_per_node=4 examples/v1_mnist.py
"""

from __future__ import annotations

import argparse
import json

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn.functional as F
from torch import nn, optim


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def digits(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(0, 10, (n,), generator=g)
    images = patterns[labels] + 0.5 * torch.randn(n, 1, 8, 8, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


@smp.step
def train_step(model, scaler, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(scaler.scale(loss))
    return output, loss


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def train(model, scaler, loader, optimizer, steps):
    model.train()
    losses = []
    for step, (data, target) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        _, loss_mb = train_step(model, scaler, data, target)
        losses.append(loss_mb.reduce_mean().item())
        scaler.step(optimizer)
        scaler.update()
    return losses


def test(model, loader):
    model.eval()
    test_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for data, target in loader:
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
            seen += len(target)
    # Every data-parallel rank evaluated its own shard: add them up.
    test_loss = sum(smp.allgather(test_loss, smp.DP_GROUP)) / sum(smp.allgather(seen, smp.DP_GROUP))
    correct = sum(smp.allgather(correct, smp.DP_GROUP))
    return test_loss, correct


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--save-partial", default="")
    parser.add_argument("--save-full", default="")
    parser.add_argument("--load", default="")
    parser.add_argument("--load-partial", type=int, default=1)
    parser.add_argument("--results", default="")
    args = parser.parse_args()

    smp.init({"partitions": args.partitions, "microbatches": 2, "ddp": True, "static_mode": True})
    torch.manual_seed(1)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)  # before wrapping, as SMP's MNIST scripts
    model = smp.DistributedModel(model)
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(optimizer)

    if args.load:  # before the first step: applied once the model is partitioned
        checkpoint = smp.load(args.load, partial=bool(args.load_partial))
        model.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])

    # Every pipeline stage of a replica reads the same batches; replicas read different shards.
    train_set, test_set = digits(64 * args.batch_size, 0), digits(4 * args.batch_size, 1)
    sampler = torch.utils.data.DistributedSampler(
        train_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=False
    )
    test_sampler = torch.utils.data.DistributedSampler(
        test_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=False
    )
    per_replica = args.batch_size // smp.dp_size()
    loader = torch.utils.data.DataLoader(train_set, batch_size=per_replica, sampler=sampler, drop_last=True)
    test_loader = torch.utils.data.DataLoader(
        test_set, batch_size=per_replica, sampler=test_sampler, drop_last=True
    )

    losses = train(model, scaler, loader, optimizer, args.steps)
    test_loss, correct = test(model, test_loader)
    if smp.rank() == 0:
        print(f"train losses {losses}\ntest loss {test_loss:.6f} correct {correct}", flush=True)

    if args.save_partial and smp.rdp_rank() == 0:
        model_dict = model.local_state_dict()
        opt_dict = optimizer.local_state_dict()
        smp.save(
            {"model_state_dict": model_dict, "optimizer_state_dict": opt_dict},
            args.save_partial,
            partial=True,
        )
    if args.save_full:
        model_dict = model.state_dict()  # collectives: every rank takes part
        opt_dict = optimizer.state_dict()
        smp.save(
            {"model_state_dict": model_dict, "optimizer_state_dict": opt_dict}, args.save_full, partial=False
        )
    full = model.state_dict()  # a collective over the pipeline: every rank takes part
    if args.results and smp.rank() == 0:
        params = {k: v.tolist() for k, v in full.items()}
        with open(args.results, "w") as f:
            json.dump({"losses": losses, "test_loss": test_loss, "correct": correct, "params": params}, f)
    smp.barrier()


if __name__ == "__main__":
    main()
