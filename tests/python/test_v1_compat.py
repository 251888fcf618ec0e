"""SMP v1 names real scripts use beyond the docs: the smdistributed alias, RankType's six rank
spaces, smp.state, smp.model_creation and smp.is_tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def test_smdistributed_alias_is_smp():
    import smdistributed.modelparallel
    import smdistributed.modelparallel.torch as smp_alias
    import smp
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm
    from smdistributed.modelparallel.torch.nn.huggingface.gptj import (
        translate_hf_gptj_state_dict_to_smdistributed,
        translate_state_dict_to_hf_gptj,
    )

    assert smp_alias is smp and smdistributed.modelparallel.__version__ == smp.__version__
    assert FusedLayerNorm is smp.nn.FusedLayerNorm
    assert smp_alias.model.DistributedModel is smp.DistributedModel  # transformers' isinstance check
    norm = FusedLayerNorm(8, eps=1e-5)
    assert set(norm.state_dict()) == set(torch.nn.LayerNorm(8).state_dict())
    sd = {"transformer.h.0.attn.c_attn.weight": torch.ones(2)}
    assert translate_state_dict_to_hf_gptj(sd, max_seq_len=None) is sd
    assert translate_hf_gptj_state_dict_to_smdistributed(sd) is sd
    for model in ("gpt2", "gptj", "gptneo", "gptneox", "bert", "roberta", "t5", "vit"):
        module = __import__(f"smdistributed.modelparallel.torch.nn.huggingface.{model}", fromlist=["x"])
        assert module is getattr(smp.nn.huggingface, model)
        assert getattr(module, f"translate_state_dict_to_hf_{model}")(sd, 1024) is sd
        assert getattr(module, f"translate_hf_state_dict_to_smdistributed_{model}")(sd) is sd


def _python(code: str, env: dict[str, str]) -> str:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1", **env)
    for var in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS"):
        if var not in env:
            full_env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120, cwd="/tmp"
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_transformers_takes_its_smp_path_only_with_the_alias_and_sagemaker_env():
    pytest.importorskip("transformers")
    code = "from transformers.utils import is_sagemaker_mp_enabled; print(is_sagemaker_mp_enabled())"
    sagemaker = {
        "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 1}),
        "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}),
    }
    assert _python(code, sagemaker) == "True"  # the alias makes `smdistributed` importable
    assert _python(code, {}) == "False"


def _rank_types_state_and_tracing(rank, world_size):
    import smp

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            seen.append(smp.is_tracing())
            return self.b(torch.relu(self.a(x)))

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "static_mode": True, "fast_mode": True})
    out = {"cfg": (smp.state.cfg.fp16, smp.state.cfg.bf16, smp.state.cfg.prescaled_batch)}
    out["cfg"] += (smp.state.cfg.shard_optimizer_state, smp.state.cfg.sharded_data_parallel_degree)
    # The LLM data pipelines' handshake: pipeline stage 0 reads, the later stages receive.
    if smp.pp_rank() == 0:
        for stage in range(1, smp.pp_size()):
            smp.send({"batch_from": rank}, stage, smp.RankType.PP_RANK)
        out["pp"] = rank
    else:
        out["pp"] = smp.recv_from(0, smp.RankType.PP_RANK)["batch_from"]
    with smp.model_creation(tensor_parallelism=False, dtype=torch.float64):
        made64 = torch.nn.Linear(2, 2).weight.dtype
    out["model_creation"] = (str(made64), str(torch.get_default_dtype()))
    model = smp.DistributedModel(Probe())
    assert smp.state.model is model and smp.state.optimizer is None
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert smp.state.optimizer is opt

    @smp.step
    def train(x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    out["before"] = smp.is_tracing()
    train(torch.ones(4, 4))
    out["traced"] = bool(seen) and all(seen)  # model code ran only under the capture
    smp.parallel_state.reset()
    smp.init({"tensor_parallel_degree": 2})
    if smp.tp_rank() == 0:
        smp.send("tp", 1, smp.TP_RANK)
    else:
        assert smp.recv_from(0, smp.RankType.TP_RANK) == "tp"
    smp.parallel_state.reset()
    smp.init({})
    if smp.rdp_rank() == 0:
        smp.send("rdp", 1, smp.RDP_RANK)
    else:
        assert smp.recv_from(0, smp.RankType.RDP_RANK) == "rdp"
    return out


def test_rank_types_state_model_creation_and_is_tracing():
    results = run_ranks(_rank_types_state_and_tracing, 2, timeout=180)
    for r in results:
        assert r["cfg"] == (False, False, False, False, 1)
        assert r["pp"] == 0
        assert r["model_creation"] == ("torch.float64", "torch.float32")
        assert r["before"] is False and r["traced"] is True


def test_state_cfg_needs_init_and_model_creation_checks_dtype():
    import smp

    if smp.is_initialized():
        pytest.skip("smp initialized in this process")
    with pytest.raises(RuntimeError, match="call smp.init"):
        smp.state.cfg  # noqa: B018
    assert smp.is_tracing() is False
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype, got torch.int64"):
        with smp.model_creation(dtype=torch.int64):
            pass


def test_step_output_indexes_iterates_and_detaches_as_smp_and_transformers_use_it():
    from smp.step import StepOutput

    out = StepOutput([torch.ones(2, requires_grad=True) * 2, torch.zeros(2)])
    assert len(out) == 2 and out[1].sum().item() == 0 and [t.shape for t in out] == [(2,), (2,)]
    # transformers' smp_nested_concat: tensor.detach().concat().cpu()
    joined = out.detach().concat().cpu()
    assert joined.tolist() == [2.0, 2.0, 0.0, 0.0] and not joined.requires_grad
