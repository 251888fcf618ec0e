"""A dense model's full state_dict loads into a model of smp.nn modules through
DistributedModel.load_state_dict (as SMP v1's docs load a translated pretrained model), and
state_dict() gives it back whole, in every layout smp.nn modules run in: each rank cuts its shards
(issue 45: "size mismatch" on every distributed parameter before the model was partitioned). The
model then trains as the dense one."""

from __future__ import annotations

import torch
from harness import run_ranks
from torch import nn

VOCAB, WIDTH, ROWS, SEQ = 16, 8, 4, 6
CLOSE = 1e-5


class Net(nn.Module):
    """An embedding and two linears, smp.nn's (distributed) or torch's, with the same keys."""

    def __init__(self, distributed: bool):
        super().__init__()
        import smp

        embedding = smp.nn.DistributedEmbedding if distributed else nn.Embedding
        linear = smp.nn.DistributedLinear if distributed else nn.Linear
        self.embed = embedding(VOCAB, WIDTH)
        self.hidden = linear(WIDTH, WIDTH)
        self.head = linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))))


def _batch(step):
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def _load_and_train(rank, world_size):
    import smp
    import torch.nn.functional as F

    out = {}
    for name, config in (
        ("tp2_rdp2_sharded_state", {"tensor_parallel_degree": 2, "shard_optimizer_state": True}),
        ("pp2_tp2", {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}),
    ):
        smp.init(config | {"prescaled_batch": True})
        torch.manual_seed(0)
        dense = Net(distributed=False)
        start = {k: v.clone() for k, v in dense.state_dict().items()}
        torch.manual_seed(1)  # other initial values: the load must replace them
        model = smp.DistributedModel(Net(distributed=True))
        model.load_state_dict(start)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        reference = torch.optim.SGD(dense.parameters(), lr=0.5)

        @smp.step
        def train(net, ids):
            loss = F.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
            net.backward(loss)
            return loss

        errors = []
        for step in range(2):
            got = train(model, _batch(step)).reduce_mean()
            optimizer.step()
            optimizer.zero_grad()
            want = F.cross_entropy(dense(_batch(step)).flatten(0, 1), _batch(step).flatten())
            want.backward()
            reference.step()
            reference.zero_grad()
            errors.append(abs(got.item() - want.item()))
        whole = model.state_dict()
        final = dense.state_dict()
        out[name] = {
            "loss_errors": errors,
            "param_error": max((whole[k] - v).abs().max().item() for k, v in final.items()),
            "moved": max((start[k] - v).abs().max().item() for k, v in final.items()),
            "local_numel": sum(p.numel() for p in model.local_parameters()),
            "dense_numel": sum(p.numel() for p in dense.parameters()),
        }
        smp.parallel_state.reset()
    return out


def test_full_state_dict_loads_into_smp_nn_shards_in_every_layout():
    for result in run_ranks(_load_and_train, 4, timeout=300):
        for name, r in result.items():
            assert max(r["loss_errors"]) < CLOSE and r["param_error"] < CLOSE, (name, r)
            assert r["moved"] > 100 * CLOSE, (name, r)
            assert r["local_numel"] < r["dense_numel"], (name, r)  # this rank holds shards
