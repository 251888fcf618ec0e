"""Patterns AWS's SMP v1 training scripts (GPT-2, GPT-J, GPT-NeoX) rely on beyond the documented API:
later pipeline stages stepping with placeholder batches, SMP's nesting of `model.module`, resuming a
checkpoint whose user_content holds numpy values and a transformers config, and DeepSpeed's names
under sharded data parallelism (parameter counts, flat fp32 shards, the gradient norm)."""

from __future__ import annotations

import argparse
import pickle

import numpy as np
import torch
from harness import run_ranks

SEQ, VOCAB = 8, 64
CLOSE = 1e-5  # losses (float32)
HF_CLOSE = 1e-4  # Hugging Face parameters after Adam steps


def _gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _batch(step, rows=4):
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(300 + step))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # a padded row: the mask is computed again on the later stage
    return ids, mask


# --- later pipeline stages step with placeholders (the scripts' DummyDataset) -------------------


def _placeholders(rank, world_size):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(_gpt2())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    reference = _gpt2()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)

    @smp.step
    def train(model, input_ids, attention_mask, args):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    errors = []
    for step in range(3):
        ids, mask = _batch(step)
        if smp.pp_rank() > 0:  # data is loaded on the first stage only; the others pass Tensor(0)s
            ids, mask = torch.Tensor(0).expand(4, 0), torch.Tensor(0).expand(4, 0)
        loss = train(model, ids, mask, argparse.Namespace(logits_output="")).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        ids, mask = _batch(step)
        halves = [
            reference(input_ids=i, attention_mask=m, labels=i).loss
            for i, m in zip(ids.chunk(2), mask.chunk(2), strict=True)
        ]
        want = sum(halves) / 2
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        errors.append(abs(loss.item() - want.item()))
    full, start = model.state_dict(), _gpt2().state_dict()
    param_error = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    moved = max((start[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    try:  # a stage passing another number of tensors: every stage raises, none waits
        extra = () if smp.pp_rank() == 0 else (torch.zeros(1),)
        train(model, *_batch(0), extra)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    return {"loss_errors": errors, "param_error": param_error, "moved": moved, "mismatch": mismatch}


def test_later_pipeline_stages_take_the_first_stages_inputs():
    for r in run_ranks(_placeholders, 2, timeout=240):
        assert max(r["loss_errors"]) < CLOSE, r["loss_errors"]
        assert r["param_error"] < HF_CLOSE and r["moved"] > 100 * HF_CLOSE
        assert "tensor arguments" in r["mismatch"] and "[2, 3]" in r["mismatch"], r["mismatch"]


# --- model.module nests as SMP v1's did; user_content resumes with numpy and configs ------------


def _nesting_and_resume(rank, world_size, folder):
    import smp
    from transformers import GPT2Config

    out = {}
    for fp16 in (False, True):
        smp.init({"fp16": fp16})
        model = smp.DistributedModel(_gpt2())
        levels, inner = 0, model.module
        while inner is not model.get_module():
            inner, levels = inner.module, levels + 1
        names = [n for n, _ in model.module.named_parameters()]
        out[f"fp16={fp16}"] = (levels, names[0], len(names) == len(list(model.parameters())))
        smp.parallel_state.reset()
    smp.init({})
    model = smp.DistributedModel(_gpt2())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4)
    content = {
        "num_params": np.prod([3, 4]),
        "dtype": np.dtype("float32"),
        "scale": np.float32(0.5),
        "rows": np.arange(3),
        "model_config": config,
        "cli_args": {"lr": 0.1, "seed": 12345},
        "lr_scheduler": {"num_iters": 7},
    }
    smp.save_checkpoint(folder, tag="ours", model=model, optimizer=optimizer, user_content=content)
    back = smp.resume_from_checkpoint(folder, tag="ours")
    out["resumed"] = (
        type(back["num_params"]).__name__,
        int(back["num_params"]),
        str(back["dtype"]),
        float(back["scale"]),
        back["rows"].tolist(),
        back["model_config"].to_dict() == config.to_dict(),
        back["cli_args"],
    )
    smp.save_checkpoint(
        folder, tag="code", model=model, optimizer=optimizer, user_content=argparse.Namespace(a=1)
    )
    try:
        smp.resume_from_checkpoint(folder, tag="code")
        out["refused"] = "loaded"
    except pickle.UnpicklingError as e:
        out["refused"] = str(e)
    out["trusted"] = smp.resume_from_checkpoint(folder, tag="code", weights_only=False).a
    return out


def test_module_nests_as_smp_v1_and_user_content_resumes_with_numpy_and_configs(tmp_path):
    r = run_ranks(_nesting_and_resume, 2, str(tmp_path), timeout=240)[0]
    assert r["fp16=False"] == (1, "module.transformer.wte.weight", True)  # model.module.module
    assert r["fp16=True"] == (2, "module.module.transformer.wte.weight", True)  # one more with fp16
    assert r["resumed"] == ("int64", 12, "float32", 0.5, [0, 1, 2], True, {"lr": 0.1, "seed": 12345})
    assert "argparse.Namespace" in r["refused"] and "weights_only=False" in r["refused"]
    assert r["trusted"] == 1


# --- sharded data parallelism answers DeepSpeed's names ------------------------------------------


def _deepspeed_names(rank, world_size):
    import smp
    import torch.distributed as dist

    smp.init({"sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    model = smp.DistributedModel(_gpt2())
    params = list(model.parameters())
    reference = _gpt2()
    pairs = list(zip(params, reference.parameters(), strict=True))
    out = {
        "shapes": all(tuple(p.ds_shape) == tuple(r.shape) for p, r in pairs),
        "numels": all(p.ds_numel == r.numel() for p, r in pairs),
        "local": sum(p.ds_tensor.ds_numel for p in params),
    }
    # The scripts' sdp_utils: offsets of each parameter's shard in its group's flat fp32 buffer.
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    offsets = []
    for group in groups:
        at, mine = 0, {}
        for p in group["params"]:
            mine[id(p)] = (at, p.ds_tensor.ds_numel)
            at += p.ds_tensor.ds_numel
        offsets.append(mine)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(groups, lr=1e-2))
    out["fp16_groups"] = [len(g) for g in optimizer.fp16_groups] == [3, len(params) - 3]

    @smp.step
    def train(model, ids):
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    ids, _ = _batch(rank, rows=2)
    train(model, ids)
    optimizer.step()
    # Norms the scripts log: squared norms of the flat shards, summed over the shard group.
    names = dict(model.get_module().named_parameters())
    errors = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            at, size = offsets[i][id(p)]
            norm = optimizer.fp32_partitioned_groups_flat[i].narrow(0, at, size).norm() ** 2
            dist.all_reduce(norm, group=optimizer.ds_param_shard_group)
            whole = next(v for n, v in names.items() if v is p).full_tensor()
            errors.append(abs(norm.sqrt().item() - whole.norm().item()))
    out["norm_error"] = max(errors)
    # _global_grad_norm: the norm of the step's gradients, as one process computes it on the batch.
    both = torch.cat([_batch(r, rows=2)[0] for r in range(world_size)])
    ref_loss = sum(reference(input_ids=i, labels=i).loss for i in both.chunk(world_size)) / world_size
    ref_loss.backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    out["grad_norm_error"] = abs(float(optimizer._global_grad_norm) - want)
    out["group_size"] = dist.get_world_size(optimizer.ds_param_shard_group)
    return out


def test_sharded_data_parallelism_answers_deepspeeds_names():
    results = run_ranks(_deepspeed_names, 2, timeout=240)
    total = sum(r["local"] for r in results)
    for r in results:
        assert r["shapes"] and r["numels"] and r["fp16_groups"]
        assert r["norm_error"] < 1e-5 and r["grad_norm_error"] < 1e-5, r
        assert r["group_size"] == 2
    assert total == sum(p.numel() for p in _gpt2().parameters())  # the shards add up to the model
