"""smp.save_checkpoint / smp.resume_from_checkpoint: training resumed from a checkpoint continues
exactly as uninterrupted training does."""

from __future__ import annotations

import pipeline_cases
import torch
from harness import run_ranks

GLOBAL_BATCH = 8


def _build(smp):
    torch.manual_seed(0)
    with smp.tensor_parallelism(smp.tp_size() > 1):
        model, batch, forward, loss_fn = pipeline_cases.CASES["gpt"]()
    dmodel = smp.DistributedModel(model)
    # Under bf16 SGD with momentum: Adam steps a parameter by ~lr whatever its gradient, so where
    # bf16 rounds a tiny gradient across zero it moves the parameter as far as training does.
    if smp.parallel_state.state().config.bf16:
        inner = torch.optim.SGD(dmodel.parameters(), lr=0.05, momentum=0.9)
    else:
        inner = torch.optim.Adam(dmodel.parameters(), lr=1e-2)
    opt = smp.DistributedOptimizer(inner)

    @smp.step
    def train_step(b):
        loss = loss_fn(forward(dmodel, b), b)
        dmodel.backward(loss)
        return loss

    def train(steps):
        per = GLOBAL_BATCH // smp.dp_size()
        for s in steps:
            b = {
                k: v[smp.dp_rank() * per : (smp.dp_rank() + 1) * per]
                for k, v in batch(s, GLOBAL_BATCH).items()
            }
            opt.zero_grad()
            train_step(b)
            opt.step()

    return dmodel, opt, train


PP2_TP2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
TP4 = {"tensor_parallel_degree": 4}
RDP4_SHARDED = {"shard_optimizer_state": True}
TP2_RDP2_SHARDED_BF16 = {"tensor_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True}
# Four stages in a V on two ranks: the tied embedding/head sits on one rank.
PP2_TP2_V = PP2_TP2 | {"pipeline": "zero_bubble_v"}
# (layout that saves, layouts that resume on 4 ranks); rdp4 sharded also resumes at rdp2 on 2 ranks
TRANSITIONS = [
    (PP2_TP2, [TP4, RDP4_SHARDED, PP2_TP2_V]),
    (RDP4_SHARDED, []),
    (TP2_RDP2_SHARDED_BF16, [PP2_TP2 | {"bf16": True}, TP2_RDP2_SHARDED_BF16]),
    (PP2_TP2_V, [PP2_TP2]),
]


def _full_files(folder: str) -> dict[str, torch.Tensor]:
    """A full checkpoint's tensors, model and optimizer, by key."""
    model = torch.load(f"{folder}/model.pt", weights_only=True)
    return {f"model/{k}": v for k, v in model.items()} | torch.load(
        f"{folder}/optimizer.pt", weights_only=True
    )


def _trained(smp, dmodel, opt, folder, tag):
    """What training left: the model's state_dict, or under bf16 the fp32 master weights (from a
    full checkpoint; the bf16 weights are them rounded, by up to 0.016 at a weight of 4: as far
    as 2 steps move them)."""
    if not smp.parallel_state.state().config.bf16:
        return dmodel.state_dict()
    smp.save_checkpoint(folder, tag, partial=False, model=dmodel, optimizer=opt, user_content=None)
    smp.barrier()
    return {k: v for k, v in _full_files(f"{folder}/{tag}").items() if k.endswith("/master")}


def _resume_on(smp, config, folder, partial, expected):
    """Resumes the step-2 checkpoint on `config`: (largest difference between the state it loaded
    and the state saved, as a full checkpoint written right after loading shows; largest
    difference after 2 more steps from 4 uninterrupted steps on the saving layout; how far those 2
    steps moved the parameters there)."""
    smp.init(config)
    dmodel, opt, train = _build(smp)
    user = smp.resume_from_checkpoint(folder, tag="step2", partial=partial)
    again = f"again_{int(partial)}"
    dmodel.register_post_partition_hook(  # runs after the resume's own hook: the loaded state
        lambda model, optimizer: smp.save_checkpoint(
            folder, again, partial=False, model=model, optimizer=optimizer, user_content=None
        )
    )
    train(range(user["step"], 4))
    got = _trained(smp, dmodel, opt, folder, f"trained_{int(partial)}")
    smp.parallel_state.reset()
    saved, loaded = _full_files(f"{folder}/step2"), _full_files(f"{folder}/{again}")
    assert saved.keys() == loaded.keys(), sorted(saved.keys() ^ loaded.keys())
    state_error = max((loaded[k].double() - saved[k].double()).abs().max().item() for k in saved)
    train_error = max((got[k].double() - expected[k].double()).abs().max().item() for k in expected)
    at_step2 = {k: saved[k if k in saved else f"model/{k}"].double() for k in expected}
    moved = max((expected[k].double() - v).abs().max().item() for k, v in at_step2.items())
    return state_error, train_error, moved


def _save_and_resume(rank, world_size, folder, both=True):
    """For each transition: 4 uninterrupted steps on the saving layout; 2 steps, saved full and
    partial (one of them in the background); each resumed on each target layout for the last 2,
    from both checkpoints (`both`), else from one, partial and full in turn (each target layout
    and each kind of checkpoint still resumes, in half the resumes)."""
    import smp

    results = []
    for i, (source, targets) in enumerate(TRANSITIONS):
        smp.init(source)
        dmodel, opt, train = _build(smp)
        train(range(4))
        expected = _trained(smp, dmodel, opt, f"{folder}/{i}", "step4")
        smp.parallel_state.reset()

        smp.init(source)
        dmodel, opt, train = _build(smp)
        train(range(2))
        for partial in (False, True):
            # rdp4's partial save is written in the background while a third step changes the
            # live state: what resumes must still be step 2's (the full checkpoint shows it)
            pending = smp.save_checkpoint(
                f"{folder}/{i}",
                "step2",
                partial=partial,
                model=dmodel,
                optimizer=opt,
                user_content={"step": 2},
                async_save=partial and source is RDP4_SHARDED,
            )
        if pending is not None:
            train(range(2, 3))
            pending.wait()
        smp.parallel_state.reset()
        if rank == 0:
            torch.save(expected, f"{folder}/{i}/expected.pt")
        for j, target in enumerate(targets):
            for partial in (True, False) if both else (j % 2 == i % 2,):
                results.append(
                    (i, str(target), partial, *_resume_on(smp, target, f"{folder}/{i}", partial, expected))
                )
    return results


def _downsize(rank, world_size, folder):
    """rdp4 sharded -> rdp2 sharded: the checkpoint of 4 ranks resumes on 2 (a smaller cluster),
    from both checkpoints."""
    import smp

    expected = torch.load(f"{folder}/expected.pt", weights_only=True)
    return [
        (1, "rdp2 sharded", partial, *_resume_on(smp, RDP4_SHARDED, folder, partial, expected))
        for partial in (True, False)
    ]


def test_any_layout_resumes_on_any_other(tmp_path, request):
    """Model and optimizer state (Adam moments and steps; under bf16 SGD's momentum and the fp32
    masters) saved after 2 steps resume on another layout exactly as saved, and the last 2 steps
    then match 4 uninterrupted ones on the saving layout (fp32, and bf16 resumed on its own layout:
    1e-6; bf16 on another layout, which rounds its gradients otherwise: its masters within 1/30 of
    how far the 2 steps moved them, measured 1/520)."""
    slow = request.config.getoption("--slow")
    results = run_ranks(_save_and_resume, 4, str(tmp_path), slow, timeout=600)[0]
    results += run_ranks(_downsize, 2, str(tmp_path / "1"), timeout=300)[0]
    assert len(results) == (14 if slow else 8), results
    assert {partial for _, _, partial, *_ in results} == {True, False}, results
    for i, target, partial, state_error, train_error, moved in results:
        assert state_error == 0.0, (i, target, partial, state_error)
        other_bf16_layout = TRANSITIONS[i][0].get("bf16", False) and target != str(TRANSITIONS[i][0])
        tolerance = moved / pipeline_cases.BF16_MOVED_PER_ERROR if other_bf16_layout else 1e-6
        assert train_error < tolerance and moved > 1e-3, (i, target, partial, train_error, moved)
    print(results)


def test_no_checkpoint_is_a_fresh_start_and_a_missing_tag_a_clear_error(tmp_path):
    import pytest

    for fresh, message in run_ranks(_missing, 2, str(tmp_path), timeout=120):
        assert fresh is None  # no checkpoint yet: a fresh start (issue 49)
        assert "does not exist" in message and "step_9" in message, message
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import smp.checkpoint

        smp.checkpoint.load(str(tmp_path / "nothing"), partial=False)


def _missing(rank, world_size, folder):
    import smp

    smp.init({"pipeline_parallel_degree": 2})
    _build(smp)
    try:
        fresh = smp.resume_from_checkpoint(folder)
        smp.resume_from_checkpoint(folder, tag="step_9")
    except FileNotFoundError as err:
        return fresh, str(err)
    finally:
        smp.parallel_state.reset()
    return fresh, "no error"
