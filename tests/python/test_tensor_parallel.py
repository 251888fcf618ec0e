"""Tensor parallelism end to end on CPU processes: parity with one process, shard sizes,
replicated fallbacks, the pass on its own, checkpoints and errors."""

from __future__ import annotations

import math
import warnings

import pipeline_cases
import pytest
import torch
from harness import RankFailure, run_ranks

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
GRAD_RTOL = 1e-5  # relative to the largest gradient

# (world size, config): tp alone, tp=4, pp=2 x tp=2, tp=2 x rdp=2.
LAYOUTS = {
    "tp2": (2, {"tensor_parallel_degree": 2}),
    "tp4": (4, {"tensor_parallel_degree": 4}),
    "pp2_tp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}),
    "tp2_rdp2": (4, {"tensor_parallel_degree": 2, "microbatches": 2}),
}


def _train_cases(rank, world_size, cases, configs):
    return {case: pipeline_cases.train_smp(rank, world_size, case, configs, 3, 16) for case in cases}


def _check(results, tp):
    for r in results:
        assert r["loss_err"] < LOSS_RTOL, r
        assert r["param_err"] < PARAM_ATOL, r
        assert r["grad_err"] < GRAD_RTOL, r
        assert r["distributed"], "nothing was sharded"
        for name in r["distributed"]:  # every shard is exactly 1/tp of its parameter
            assert r["local_numel"][name] * tp == r["full_numel"][name], name


# tp2_rdp2 with --slow (tp x rdp trains at parity by default in test_optimizer.py's
# tp2_rdp2 and test_activation_checkpointing.py's tp2_rdp2_sharded)
@pytest.mark.parametrize(
    "layout", ["tp2", "tp4", "pp2_tp2", pytest.param("tp2_rdp2", marks=pytest.mark.slow)]
)
def test_parity(layout):
    world_size, base = LAYOUTS[layout]
    configs = [base | {"prescaled_batch": prescaled} for prescaled in (False, True)]
    # qknorm: replicated per-head norm weights inside the sharded heads (their gradients summed over tp).
    # forms: linears spelled x @ W.T + b, einsum and matmul on [in, out] weights (Falcon-style).
    per_rank = run_ranks(
        _train_cases, world_size, ["gpt", "gqa", "mqa", "qknorm", "forms"], configs, timeout=600
    )
    tp = base["tensor_parallel_degree"]
    # One key/value head: k and v replicated on every rank, the query heads and the MLP cut
    # (in every block, whichever stage holds it).
    mqa = {n for by_case in per_rank for n in by_case["mqa"][0]["distributed"]}
    for i in range(2):
        for layer in ("q", "o", "gate", "up", "down"):
            assert f"blocks.{i}.{layer}.weight" in mqa, (i, layer, sorted(mqa))
        assert not {f"blocks.{i}.k.weight", f"blocks.{i}.v.weight"} & mqa, sorted(mqa)
    for by_case in per_rank:
        for results in by_case.values():
            _check(results, tp)
        gpt = by_case["gpt"][0]["distributed"]
        # Megatron pairs in every block, the vocab-parallel embedding tied to the head.
        blocks_here = {n.split(".")[1] for n in gpt if n.startswith("blocks.")}
        for i in blocks_here:
            for layer in ("attn.qkv.weight", "attn.proj.weight", "mlp.0.weight", "mlp.2.weight"):
                assert f"blocks.{i}.{layer}" in gpt, (i, layer, gpt)
        gqa = by_case["gqa"][0]["distributed"]
        assert any(n.endswith("k.weight") for n in gqa) and any(n.endswith("down.weight") for n in gqa)
        forms = by_case["forms"][0]["distributed"]
        for i in {n.split(".")[1] for n in forms if n.startswith("blocks.")}:
            for name in ("attn.qkv.weight", "attn.proj.weight", "mlp.up", "mlp.up_bias", "mlp.down"):
                assert f"blocks.{i}.{name}" in forms, (i, name, forms)


def _parameter_bytes(rank, world_size):
    import smp

    smp.init({"tensor_parallel_degree": world_size})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = pipeline_cases.models.GPT(layers=2)
    full = {n: p.numel() for n, p in model.named_parameters()}
    dmodel = smp.DistributedModel(model)

    @smp.step
    def forward(ids):
        return dmodel(ids).sum()

    forward(torch.randint(0, 64, (4, 16)))
    local = dict(dmodel.local_named_parameters())
    distributed = sum(p.numel() for p in local.values() if dmodel.is_distributed_parameter(p))
    replicated = sum(p.numel() for p in local.values() if not dmodel.is_distributed_parameter(p))
    modules = [type(m).__name__ for m in dmodel.distributed_modules()]
    return distributed, replicated, sum(full.values()), modules


def test_parameter_bytes_per_rank():
    for distributed, replicated, total, modules in run_ranks(_parameter_bytes, 2, timeout=180):
        # Linear and embedding weights are halved; what stays whole is norms, row biases, positions.
        assert distributed * 2 + replicated == total
        assert replicated < 0.1 * total, (replicated, total)
        assert set(modules) == {"Linear", "Embedding"}


def _indivisible_heads(rank, world_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs = [{"tensor_parallel_degree": 2, "prescaled_batch": p} for p in (False, True)]
        results = pipeline_cases.train_smp(rank, world_size, "gpt_3heads", configs, 3, 8)
    return results, [str(w.message) for w in caught if "tensor parallelism" in str(w.message)]


def test_indivisible_heads_stay_replicated():
    for results, messages in run_ranks(_indivisible_heads, 2, timeout=300):
        for r in results:
            assert r["loss_err"] < LOSS_RTOL and r["param_err"] < PARAM_ATOL, r
            assert "blocks.0.attn.qkv.weight" not in r["distributed"]
            assert "blocks.0.mlp.0.weight" in r["distributed"]
        assert any("blocks.0.attn" in m and "heads" in m and "3" in m for m in messages), messages


def _pass_alone(rank, world_size):
    """The pass by itself: the rewritten graph computes the original function on every rank,
    and a DistributedModel loads an unsharded checkpoint into its shards."""
    import smp
    import torch.distributed as dist

    torch.manual_seed(0)
    model = pipeline_cases.models.GPT(layers=2)
    ids = torch.randint(0, 64, (2, 16))
    expected = model(ids)
    captured = smp.passes.capture(model, (ids,))
    marked = {path for path, _ in model.named_modules()}
    result = smp.passes.tensor_parallel(captured.graph_module, dist.group.WORLD, marked)
    got = captured.graph_module(ids)[0]
    ops = {str(n.target) for n in captured.graph_module.graph.nodes}
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    with smp.tensor_parallelism():
        fresh = pipeline_cases.models.GPT(layers=2)
    dmodel = smp.DistributedModel(fresh)

    @smp.step
    def forward(x):
        return dmodel(x)

    forward(ids)
    dmodel.load_state_dict(checkpoint)
    reloaded = forward(ids).outputs[0]
    roundtrip = dmodel.state_dict()
    dmodel.eval()  # the eval-mode graph was captured and sharded too
    evaluated = forward(ids).outputs[0]
    return {
        "err": (got - expected).abs().max().item(),
        "reload_err": max((t - expected).abs().max().item() for t in (reloaded, evaluated)),
        "roundtrip": all(torch.equal(roundtrip[k], checkpoint[k]) for k in checkpoint),
        "ops": ops,
        "specs": {k: (s.dim, s.blocks) for k, s in result.specs.items()},
    }


def test_pass_computes_the_same_function():
    for r in run_ranks(_pass_alone, 2, timeout=180):
        assert r["err"] < 1e-5 and r["reload_err"] < 1e-5, r
        assert r["roundtrip"]
        assert {"smp.column_parallel_linear.default", "smp.row_parallel_linear.default"} <= r["ops"]
        assert "smp.vocab_parallel_embedding.default" in r["ops"]
        assert r["specs"]["blocks.0.attn.qkv.weight"] == (0, 3)  # fused q/k/v: each part split
        assert r["specs"]["blocks.0.attn.proj.weight"] == (1, 1)
        assert r["specs"]["head.weight"] == (0, 1)


def _prescaled_mismatch(rank, world_size):
    import smp

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    with smp.tensor_parallelism():
        dmodel = smp.DistributedModel(pipeline_cases.models.GPT(layers=1))

    @smp.step
    def forward(x):
        return dmodel(x)

    forward(torch.full((2, 16), rank))  # each rank reads its own data: not a prescaled batch


def test_prescaled_batch_must_match_across_the_group():
    with pytest.raises(RankFailure, match="prescaled_batch=True every rank of a tensor-parallel group"):
        run_ranks(_prescaled_mismatch, 2, timeout=120)


def _delayed_init(rank, world_size):
    import smp

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": True, "tensor_parallel_seed": 7})
    with smp.delay_param_initialization(), smp.tensor_parallelism():
        model = pipeline_cases.models.GPT(layers=2)
    meta_before = all(p.is_meta for p in model.parameters())
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(dmodel.parameters(), lr=1e-3))

    @smp.step
    def train_step(ids):
        loss = pipeline_cases.models.lm_loss(dmodel(ids), ids)
        dmodel.backward(loss)
        return loss

    batch = pipeline_cases.CASES["counting"]()[1]
    losses = []
    for s in range(3):
        opt.zero_grad()
        losses.append(train_step(batch(s, 8)["ids"]).reduce_mean().item())
        if s == 0:
            # numpy: tensors would travel back by shared memory that dies with this process
            initial = {n: p.detach().numpy().copy() for n, p in dmodel.local_named_parameters()}
        opt.step()
    return {
        "meta_before": meta_before,
        "meta_after": any(p.is_meta for p in dmodel.parameters()),
        "initial": initial,
        "distributed": [n for n, p in dmodel.local_named_parameters() if dmodel.is_distributed_parameter(p)],
        "losses": losses,
    }


def test_delayed_initialization_initializes_each_shard():
    a, b = run_ranks(_delayed_init, 2, timeout=180)
    assert a["meta_before"] and not a["meta_after"] and not b["meta_after"]
    for name, array in a["initial"].items():
        same = (array == b["initial"][name]).all()
        assert same == (name not in a["distributed"]), name  # shards differ, replicated ones agree
    # A row-parallel shard [32, 16] draws from the whole weight's distribution (fan-in 32, not 16).
    proj = torch.from_numpy(a["initial"]["blocks.0.attn.proj.weight"])
    assert proj.shape == (32, 16)
    bound = 1 / 32**0.5
    assert 0.8 * bound < proj.abs().max() <= bound
    assert all(math.isfinite(x) for x in a["losses"])


class _WeightMatmul(torch.nn.Module):
    """Products with functions of raw parameters, not with the parameters: no linear layer to cut."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(64, 16) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(16, 64) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ torch.tanh(self.w1.T)) @ (2 * self.w2.T)


def _coverage_run(model_fn, x):
    import smp

    smp.init({"tensor_parallel_degree": 2})
    with smp.tensor_parallelism():
        model = model_fn()
    dmodel = smp.DistributedModel(model)

    @smp.step
    def forward(x):
        return dmodel(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward(x)
    report = dmodel.tensor_parallel_report()
    smp.parallel_state.reset()
    return report.sharded_share, str(report), [str(w.message) for w in caught]


def _coverage(rank, world_size):
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    gpt = _coverage_run(lambda: pipeline_cases.models.GPT(layers=2), ids)
    plain = _coverage_run(_WeightMatmul, torch.randn(4, 16))
    return gpt, plain


def test_coverage_report_and_warning_when_little_is_sharded():
    for gpt, plain in run_ranks(_coverage, 2, timeout=180):
        share, report, caught = gpt
        # Every matrix of the GPT is cut (the embeddings vocab-parallel, the head tied to one).
        assert share == 1.0, report
        assert "100% of the marked matrix parameters sharded" in report, report
        assert not any("saves little memory" in m for m in caught), caught
        share, report, caught = plain
        assert share == 0.0, report
        assert "0% of the marked matrix parameters sharded" in report
        assert "replicated w1 (0.00 MiB): no tensor-parallel rule cuts the way it is used" in report
        assert any("less than 80% of the marked matrix parameters are sharded" in m for m in caught), caught
