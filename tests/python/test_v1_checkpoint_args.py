"""SMP v1's save/load arguments and partial-state marks, as scripts and transformers pass them."""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_ranks


def _pipeline_net():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _one_step(smp, model) -> None:
    """The first step (the model is partitioned in it)."""

    @smp.step
    def train(x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    train(torch.ones(2, 4))


def _save_load_marks(rank, world_size, folder):
    import smp

    net = _pipeline_net()
    full = {k: v.clone() for k, v in net.state_dict().items()}
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    out = {}
    # Before partitioning: an optimizer state is deferred (it belongs to the parameters kept later).
    # (Each stage keeps one Linear: a state for two parameters, as a stage's saved part has.)
    opt.load_state_dict(torch.optim.Adam([torch.zeros(1), torch.zeros(1)], lr=0.5).state_dict())
    out["lr_before_step"] = opt.param_groups[0]["lr"]

    _one_step(smp, model)
    out["lr_after_partition"] = opt.param_groups[0]["lr"]
    opt.step()
    # smp.save(partial=False) writes once (from rank 0), whatever other ranks pass.
    smp.save({"from": rank}, os.path.join(folder, "once.pt"), partial=False, v3=False)
    smp.barrier()
    out["once"] = smp.load(os.path.join(folder, "once.pt"), partial=False, back_compat=True)
    local = model.local_state_dict()
    out["local_is_marked"] = local._metadata[""]["smp_partial"]
    local_opt = opt.local_state_dict(gather_if_shard=False)
    smp.save({"model": local, "opt": local_opt}, os.path.join(folder, "part.pt"), partial=True, v3=True)
    # transformers marks a full dict with SMP's key set to False: it loads as a full state.
    changed = {k: v + 1 for k, v in full.items()} | {"_smp_is_partial": False}
    model.load_state_dict(changed)
    out["full_loaded"] = all(torch.equal(v, changed[k]) for k, v in model.local_state_dict().items())
    # The partial file loads back into this rank's part (after partitioning: at once).
    back = smp.load(os.path.join(folder, "part.pt"), partial=True)
    model.load_state_dict(back["model"])
    out["partial_loaded"] = all(torch.equal(v, back["model"][k]) for k, v in model.local_state_dict().items())
    whole = opt.state_dict()  # the whole model's: every stage's part
    out["stages_in_whole"] = len(whole["smp_model_parallel_states"])
    opt.load_state_dict(whole)
    try:
        opt.load_state_dict(whole | {"smp_model_parallel_layout": (4, 1)})
    except ValueError as e:
        out["layout_error"] = str(e)
    return out


def test_save_load_arguments_marks_and_deferred_optimizer_load(tmp_path):
    results = run_ranks(_save_load_marks, 2, str(tmp_path), timeout=180)
    for r in results:
        assert r["lr_before_step"] == pytest.approx(0.1) and r["lr_after_partition"] == pytest.approx(0.5)
        assert r["once"] == {"from": 0}
        assert r["local_is_marked"] is True
        assert r["full_loaded"] and r["partial_loaded"]
        assert r["stages_in_whole"] == 2
        assert (
            "gathered with (pipeline, tensor) parallel degrees (4, 1), but this run has (2, 1)"
            in r["layout_error"]
        )


def _resume_one_file(rank, world_size, folder):
    import smp

    net = _pipeline_net()
    saved = {k: v + 1 for k, v in net.state_dict().items()}
    if rank == 0:
        torch.save(saved, os.path.join(folder, "pytorch_model.bin"))  # as transformers' Trainer saves
    smp.barrier()
    model = smp.DistributedModel(net)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    # transformers' Trainer: a full checkpoint that is one state_dict file, before the first step.
    content = smp.resume_from_checkpoint(folder, tag="pytorch_model.bin", partial=False, load_optimizer=False)

    _one_step(smp, model)
    full = model.state_dict()
    return content is None and all(torch.equal(full[k], v) for k, v in saved.items())


def test_resume_from_a_single_state_dict_file_as_transformers_does(tmp_path):
    assert run_ranks(_resume_one_file, 2, str(tmp_path), timeout=180) == [True, True]
