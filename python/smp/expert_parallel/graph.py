"""Expert parallelism in a captured graph (pipeline stages): each experts module becomes one call.

torch.export traces an experts module's forward (transformers' `grouped_mm` implementation: sort
the (token, expert) pairs, grouped matmuls over the whole banks, scatter back) as ATen nodes. With
expert parallelism the module exchanges tokens with its ep group instead, and how many arrive is
known only once the counts are exchanged: no graph holds that. So before partitioning, `collapse`
replaces each experts module's nodes by one node calling `ExpertsCall` on the module's inputs
(hidden_states, top_k_index, top_k_weights) and its banks (as get_attr inputs: the stage holding
the call holds the banks, and the partition keeps the module on one stage). The node carries the
FLOPs of the nodes it replaced, for the partition's balance. At run time the stage graphs run
eagerly under autograd: the call is the module's own forward while it holds every expert, and
smp's exchange (`bank.exchange`) once `distribute` cut it to this rank's block.
"""

from __future__ import annotations

import torch
from torch import fx

from smp.expert_parallel.bank import exchange, expert_slice
from smp.expert_parallel.find import ExpertBank, ExpertLayoutError
from smp.passes import cost
from smp.passes.fx_utils import fetch_attr, module_stack


class ExpertsCall:
    """What a collapsed experts node calls: `module`'s experts on the pairs routed to them."""

    def __init__(self, bank: ExpertBank):
        self.module, self.names, self.path = bank.module, bank.banks, bank.path
        self.__name__ = "smp_experts"  # (torch.fx names the node's global from it)

    @torch.compiler.disable  # (compiled stages: the pairs a rank receives are known only at run time)
    def __call__(self, hidden, top_k_index, top_k_weights, *banks):
        if expert_slice(self.module) is None:  # every expert still here (capture, timing runs)
            return type(self.module).forward(self.module, hidden, top_k_index, top_k_weights)
        return exchange(
            self.module, hidden, top_k_index, top_k_weights, dict(zip(self.names, banks, strict=True))
        )


def collapse(gm: fx.GraphModule, calls: list[ExpertsCall]) -> None:
    """Replaces the nodes of each experts module in `gm` by one node calling its ExpertsCall (named
    after the module's path, so the graphs of both train/eval modes agree)."""
    for call in calls:
        _collapse_one(gm, call)
    gm.graph.lint()
    gm.recompile()


def _collapse_one(gm: fx.GraphModule, call: ExpertsCall) -> None:
    region = [n for n in gm.graph.nodes if n.op == "call_function" and call.path in module_stack(n)]
    if not region:
        return  # the module does not run in this mode's forward
    inside = set(region)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    banks = {id(getattr(call.module, name)): name for name in call.names}
    bank_nodes: dict[str, fx.Node] = {}
    inputs: list[fx.Node] = []
    for node in region:
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                name = banks.get(id(fetch_attr(gm, a.target)))
                if name is not None:
                    bank_nodes.setdefault(name, a)
            elif a not in inside and a not in inputs:
                inputs.append(a)
    hidden, index, weights = _forward_inputs(call, inputs, outputs)
    missing = [name for name in call.names if name not in bank_nodes]
    if missing:
        raise ExpertLayoutError(
            f"smp expert parallelism: the captured forward of {call.path!r} does not read its banks "
            f"{missing}; smp cannot place its experts on ranks: set expert_parallel_degree to 1"
        )
    (out,) = outputs
    with gm.graph.inserting_after(out):
        node = gm.graph.create_node(
            "call_function",
            call,
            (hidden, index, weights, *(bank_nodes[name] for name in call.names)),
            name="smp_experts_" + call.path.replace(".", "_"),
        )
    node.meta.update({k: out.meta[k] for k in ("val", "nn_module_stack", "stack_trace") if k in out.meta})
    node.meta[cost.REGION_FLOPS] = sum(cost.node_flops(n) for n in region)
    out.replace_all_uses_with(node)
    for n in reversed(region):
        gm.graph.erase_node(n)


def _forward_inputs(call: ExpertsCall, inputs: list[fx.Node], outputs: list[fx.Node]):
    """(hidden_states, top_k_index, top_k_weights) among the region's inputs, by their values:
    the index is the one integer tensor, the weights the float of its shape, the rest the tokens."""
    values = [n.meta.get("val") for n in inputs]
    index = [
        n
        for n, v in zip(inputs, values, strict=True)
        if isinstance(v, torch.Tensor) and not v.is_floating_point()
    ]
    floats = [
        n
        for n, v in zip(inputs, values, strict=True)
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    if len(outputs) == 1 and len(index) == 1 and len(floats) == 2 and len(inputs) == 3:
        shape = index[0].meta["val"].shape
        weights = [n for n in floats if n.meta["val"].shape == shape]
        hidden = [n for n in floats if n.meta["val"].shape != shape]
        if len(weights) == 1 and len(hidden) == 1:
            return hidden[0], index[0], weights[0]
    raise ExpertLayoutError(
        f"smp expert parallelism: the captured forward of {call.path!r} "
        f"({type(call.module).__name__}) reads {[n.name for n in inputs]} and gives "
        f"{[n.name for n in outputs]}, not (hidden_states, top_k_index, top_k_weights) -> one tensor "
        "as transformers' experts modules do; set expert_parallel_degree to 1 for this model"
    )


def held(banks: list[ExpertBank]) -> list[ExpertBank]:
    """The banks whose parameters this rank still holds (pipeline stages free the others')."""
    return [b for b in banks if set(b.banks) <= set(dict(b.module.named_parameters(recurse=False)))]
