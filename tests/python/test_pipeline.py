"""Pipeline parallelism end to end on CPU processes: parity with one process, memory, errors."""

from __future__ import annotations

import math

import pipeline_cases
import pytest
import torch
from harness import RankFailure, run_ranks

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
GRAD_RTOL = 1e-5  # relative to the largest gradient

# (pipeline_parallel_degree, data-parallel degree); pp2 x dp2 with --slow (it trains at parity by
# default in test_optimizer.py's pp2_rdp2 and test_hf_models.py's pp2_rdp2_sharded_zero_bubble)
LAYOUTS = [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow), (4, 1)]


def _check_parity(results):
    for r in results:
        assert r["loss_err"] < LOSS_RTOL, r
        assert r["param_err"] < PARAM_ATOL, r
        assert r["grad_err"] < GRAD_RTOL, r


@pytest.mark.parametrize("pp,dp", LAYOUTS)
def test_gpt_parity(pp, dp):
    # One launch per layout runs every schedule and microbatch count (smp.parallel_state.reset between).
    configs = [
        {"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": schedule}
        for schedule in ("interleaved", "simple")
        for m in (1, 2, 4, 8)
    ]
    # Global batch 16: 8 (or 16) rows per replica divide into every microbatch count.
    per_rank = run_ranks(pipeline_cases.train_smp, pp * dp, "gpt", configs, 3, 16, timeout=600)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(configs)
        _check_parity(results)
        # The tied embedding is replicated on the first and last stage, and only there.
        stage = rank % pp
        for r in results:
            assert r["shared"] == ["tok.weight"]
            assert ("tok.weight" in r["local"]) == (stage in (0, pp - 1)), (stage, r["local"])
            assert ("ln_f.weight" in r["local"]) == (stage == pp - 1)


@pytest.mark.parametrize("case", ["twice", "skip", "dict", "returns_twice"])
def test_model_shapes_parity(case):
    # zero_bubble_v too: four stages in a V, so a value returned twice, a model output of an earlier
    # stage of the rank that computes the loss, or a submodule called at both ends meet on one rank.
    config = {"pipeline_parallel_degree": 2, "microbatches": 4}
    configs = [config, config | {"pipeline": "zero_bubble_v"}]
    results = run_ranks(pipeline_cases.train_smp, 2, case, configs, 3, 8, timeout=180)
    for per_config in results:
        _check_parity(per_config)
    if case == "twice":
        # The submodule called at both ends is replicated on both stages (under zero_bubble_v the
        # first and last stages share rank 0: one tensor there, nothing to sum across ranks).
        assert results[0][0]["shared"] == ["shared.bias", "shared.weight"]


def test_manual_partition_parity():
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False}
    manual = {"blocks.3": 1, "ln_f": 1}
    results = run_ranks(pipeline_cases.train_smp, 2, "gpt", config, 3, 8, {"manual": manual}, timeout=180)
    _check_parity(results)
    assert "blocks.2.mlp.0.weight" in results[0]["local"]
    assert not any(n.startswith("blocks.2") for n in results[1]["local"])
    assert "blocks.3.mlp.0.weight" in results[1]["local"]


def test_manual_partition_zero_bubble_v_parity():
    """smp.set_partition with the 2p stages of zero_bubble_v: rank 0 holds stages 0 and 3, rank 1
    stages 1 and 2."""
    config = {
        "pipeline_parallel_degree": 2,
        "microbatches": 4,
        "auto_partition": False,
        "pipeline": "zero_bubble_v",
    }
    manual = {"blocks.1": 1, "blocks.2": 2, "blocks.3": 3, "ln_f": 3}
    results = run_ranks(pipeline_cases.train_smp, 2, "gpt", config, 3, 8, {"manual": manual}, timeout=180)
    _check_parity(results)
    rank0, rank1 = (set(r["local"]) for r in results)
    assert {"blocks.0.mlp.0.weight", "blocks.3.mlp.0.weight", "ln_f.weight", "tok.weight"} <= rank0
    assert {"blocks.1.mlp.0.weight", "blocks.2.mlp.0.weight"} <= rank1
    assert not any(n.startswith(("blocks.1", "blocks.2")) for n in rank0)
    # The tied embedding/head is shared by stages 0 and 3, one tensor on rank 0.
    assert results[0]["shared"] == ["tok.weight"] and "tok.weight" not in rank1


def test_replicas_seeded_differently_start_equal_and_measured_costs():
    config = {"pipeline_parallel_degree": 2, "microbatches": 2}
    options = {"seed_by_dp_rank": True, "model_kwargs": {"trace_execution_times": True}}
    _check_parity(run_ranks(pipeline_cases.train_smp, 4, "gpt", config, 2, 8, options, timeout=240))


def test_partition_context_and_set_partition():
    import smp
    from smp.pipeline.partitioning import module_partitions

    with smp.partition(1):
        outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with smp.partition(0):
            inner = torch.nn.Linear(2, 2)
        outer.append(inner)
    free = torch.nn.Linear(2, 2)
    root = torch.nn.Sequential(outer, free)
    assert module_partitions(root) == {"0": 1, "0.0": 1, "0.1": 0}
    smp.set_partition(root, 2)
    assert module_partitions(root) == {"": 2, "0": 1, "0.0": 1, "0.1": 0, "1": 2}
    with pytest.raises(ValueError, match="partition index must be an int >= 0, got -1"):
        smp.set_partition(free, -1)
    assert type(torch.nn.Linear(1, 1)).__init__ is torch.nn.Linear.__init__
    assert torch.nn.Module.__init__ is smp.module_marks._original_init
    # Partition and tensor-parallel blocks nest in either order.
    with smp.tensor_parallelism():
        with smp.partition(1):
            both = torch.nn.Linear(2, 2)
            with smp.tensor_parallelism(False):
                partition_only = torch.nn.Linear(2, 2)
    assert (both._smp_partition, both._smp_tensor_parallel) == (1, True)
    assert (partition_only._smp_partition, partition_only._smp_tensor_parallel) == (1, False)
    assert torch.nn.Module.__init__ is smp.module_marks._original_init


def test_interleaved_bounds_saved_activations():
    configs = [
        {"pipeline_parallel_degree": 2, "microbatches": 8, "pipeline": schedule, "active_microbatches": 2}
        for schedule in ("simple", "interleaved")
    ]
    options = {"track_activations": True}
    for simple, interleaved in run_ranks(
        pipeline_cases.train_smp, 2, "gpt", configs, 1, 16, options, timeout=180
    ):
        assert simple["activation_peak"] > 0
        # At most 2 of 8 microbatches hold activations instead of all 8.
        assert interleaved["activation_peak"] * 3 <= simple["activation_peak"], (interleaved, simple)


def _state_and_api(rank, world_size):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model, batch, forward, loss_fn = pipeline_cases.CASES["gpt"]()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    dmodel = smp.DistributedModel(model)

    @smp.step(non_split_inputs=["scale"])
    def evaluate(b, scale):
        return loss_fn(forward(dmodel, b), b) * scale, forward_count(b)

    def forward_count(b):
        return b["ids"].shape[0]

    with torch.no_grad():
        losses, rows = evaluate(batch(0, 4), torch.tensor(2.0))
    gathered = dmodel.state_dict()
    local = dmodel.local_state_dict()
    same = all(torch.equal(gathered[k], full[k]) for k in full) and list(gathered) == list(full)
    # Loading the full state after partitioning sets only local tensors.
    changed = {k: v + 1 for k, v in full.items()}
    dmodel.load_state_dict(changed)
    loaded = all(torch.equal(v, changed[k]) for k, v in dmodel.local_state_dict().items())
    return {
        "same": same,
        "loaded": loaded,
        "local_keys": sorted(local),
        "full_keys": len(full),
        "rows": rows.outputs,
        "loss_mean": losses.reduce_mean().item(),
        "loss_outputs": len(losses.outputs),
        "report": dmodel.partition_report(),
        "local_modules": len(dmodel.local_modules()),
    }


def test_state_dict_gather_and_load():
    r0, r1 = run_ranks(_state_and_api, 2, timeout=120)
    assert r0["same"] and r1["same"]
    assert r0["loaded"] and r1["loaded"]
    assert r0["rows"] == [2, 2] and r0["loss_outputs"] == 2
    assert r0["loss_mean"] == pytest.approx(r1["loss_mean"])
    assert set(r0["local_keys"]) | set(r1["local_keys"]) >= {k for k in r0["local_keys"]}
    assert len(set(r0["local_keys"]) | set(r1["local_keys"])) == r0["full_keys"]
    assert "stage 0" in r0["report"] and "tok.weight" in r0["report"]


def _train_then_eval(rank, world_size):
    import copy

    import smp

    # One microbatch: BatchNorm's batch statistics then match the unsplit model's.
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1})
    torch.manual_seed(0)
    model, batch, forward, loss_fn = pipeline_cases.CASES["normed"]()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    dmodel = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(dmodel.parameters(), lr=0.1))

    @smp.step
    def train(b):
        loss = loss_fn(forward(dmodel, b), b)
        dmodel.backward(loss)
        return loss

    @smp.step
    def predict(b):
        return forward(dmodel, b)

    for s in range(2):
        b = batch(s, 8)
        ref_opt.zero_grad()
        loss_fn(forward(reference, b), b).backward()
        ref_opt.step()
        opt.zero_grad()
        train(b)
        opt.step()
    dmodel.eval()
    reference.eval()
    b = batch(5, 8)
    ref_state = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.no_grad():
        got = predict(b).concat()
        expected = forward(reference, b)
        train_mode = forward(reference.train(), b)  # (updates the reference's running statistics)
    buffers = {
        k: (v - ref_state[k]).abs().max().item()
        for k, v in dmodel.local_state_dict().items()
        if "running" in k
    }
    return (got - expected).abs().max().item(), (got - train_mode).abs().max().item(), buffers


def test_eval_mode_after_training_uses_the_eval_graph():
    results = run_ranks(_train_then_eval, 2, timeout=120)
    for eval_err, train_gap, buffers in results:
        assert eval_err < 1e-5
        assert train_gap > 1e-3  # the modes really differ for this model
        assert all(err < 1e-6 for err in buffers.values()), buffers
    # The running statistics live on exactly one stage and were updated like the reference's.
    assert sum(len(buffers) for _, _, buffers in results) == 2


def _errors(rank, world_size):
    import smp

    smp.init({"microbatches": 2})
    messages = {}

    def catch(name, fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError) as err:
            messages[name] = str(err)

    net = torch.nn.Linear(4, 1)
    stale = torch.optim.SGD(net.parameters(), lr=0.1)
    early = torch.optim.SGD(net.parameters(), lr=0.1)  # built before wrapping, then wrapped
    model = smp.DistributedModel(net)
    catch("outside", lambda: model(torch.zeros(2, 4)))
    catch("backward_outside", lambda: model.backward(torch.zeros(())))
    wrapped_early = smp.DistributedOptimizer(early)  # SMP's MNIST order: followed to the model's parameters
    if [id(p) for p in wrapped_early.param_groups[0]["params"]] == [id(p) for p in model.parameters()]:
        messages["stale_wrap"] = "remapped to the model's parameters"
    catch("second_model", lambda: smp.DistributedModel(torch.nn.Linear(1, 1)))
    smp.parallel_state.state().model = None
    catch("passes_per_step", lambda: smp.DistributedModel(torch.nn.Linear(1, 1), backward_passes_per_step=0))
    smp.parallel_state.state().model = model

    @smp.step
    def train(x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    catch("indivisible", lambda: train(torch.zeros(3, 4)))
    catch("zero_dim", lambda: train(torch.tensor(1.0)))

    def stale_step():
        train(torch.zeros(2, 4))
        stale.step()

    catch("stale_step", stale_step)

    @smp.step
    def twice(x):
        return model(x) + model(x)

    catch("twice", lambda: twice(torch.zeros(2, 4)))

    @smp.step
    def backward_twice(x):
        loss = model(x).sum()
        model.backward(loss)
        model.backward(loss)

    catch("backward_twice", lambda: backward_twice(torch.zeros(2, 4)))
    catch("bad_split_name", lambda: smp.step(non_split_inputs=["nope"])(lambda x: x))
    # The step machinery still works after all those failures, with an LR scheduler.
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = model.get_module().weight.detach().clone()
    ok = train(torch.ones(2, 4)).reduce_sum().item()
    opt.step()
    scheduler.step()
    moved = (model.get_module().weight - before).abs().max().item()
    return messages, ok, opt.param_groups[0]["lr"], moved


def test_error_messages():
    [(messages, ok, lr, moved)] = run_ranks(_errors, 1, timeout=120)
    assert lr == pytest.approx(0.05) and moved > 0
    assert "inside a function decorated with @smp.step" in messages["outside"]
    assert "model.backward(loss) can only be called inside" in messages["backward_outside"]
    # An optimizer built before wrapping is remapped when wrapped (issue 14, item 7; was an error).
    assert messages["stale_wrap"] == "remapped to the model's parameters"
    assert "a DistributedModel already exists" in messages["second_model"]
    # backward_passes_per_step=N accumulates gradients now (issue 14, item 5; N=2 was an error).
    assert "backward_passes_per_step=0 must be >= 1" in messages["passes_per_step"]
    assert "batch size 3" in messages["indivisible"] and "2 microbatches" in messages["indivisible"]
    assert "drop_last=True" in messages["indivisible"]
    assert "0-dim" in messages["zero_dim"] and "non_split_inputs" in messages["zero_dim"]
    assert "before smp.DistributedModel wrapped it" in messages["stale_step"]
    assert "called twice" in messages["twice"]
    assert "backward was called twice" in messages["backward_twice"]
    assert "'nope'" in messages["bad_split_name"]
    assert math.isfinite(ok)


def _too_small(rank, world_size, schedule="interleaved"):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "pipeline": schedule})
    layers = 1 if schedule == "interleaved" else 3
    model = smp.DistributedModel(torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers))))

    @smp.step
    def run(x):
        return model(x)

    run(torch.zeros(2, 4))


def test_model_too_small_to_split():
    with pytest.raises(RankFailure, match="model too small to split: 1 partitionable unit"):
        run_ranks(_too_small, 2, timeout=120)
    # zero_bubble_v cuts 4 stages at pp=2: three layers are too few, and the error says why.
    with pytest.raises(RankFailure, match=r"(?s)3 partitionable unit.*'zero_bubble_v' schedule cuts"):
        run_ranks(_too_small, 2, "zero_bubble_v", timeout=120)
