"""Linear layers by what they compute, not by how the model spells them.

Models write `x @ W^T + b` many ways: nn.Linear (aten.linear), transformers' Conv1D (addmm on a
[in, out] weight), FalconLinear's `x @ self.weight.T + self.bias`, `torch.matmul(x, W)` on a
raw [in, out] parameter, `torch.einsum("bsi,oi->bso", x, W)`. Before the rewrite, this pass
turns every such product of a value and a 2-D parameter into one of two ops the layer rules
cut: aten.linear (weight [out, in]) or `linear_in_out` (weight [in, out]), with a 1-D
parameter added to the result folded in as the bias. The rewritten graph computes the same
function; a form it does not recognize stays as it is (run whole, replicated, and reported).

Mixture-of-experts banks are linears too: transformers applies a [experts, out, in] parameter
to tokens sorted by expert with a grouped matmul (`transformers::grouped_mm_fallback`, or
aten._grouped_mm) on its transpose. That becomes `grouped_linear(x, bank, offsets)`, which
the layer rules cut like a linear: every expert's matrix sliced the same way.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from .fx_utils import fetch_attr

aten = torch.ops.aten

# Ops that transpose a 2-D tensor: W.T, W.t(), W.transpose(0, 1), W.permute(1, 0).
_TRANSPOSES = (aten.numpy_T.default, aten.t.default, aten.transpose.int, aten.permute.default)
_PRODUCTS = (aten.matmul.default, aten.mm.default)


def linear_in_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight (+ bias), the weight stored [in, out]: the op this pass makes of such products."""
    out = torch.matmul(x, weight)
    return out if bias is None else out + bias


def grouped_linear(x: torch.Tensor, bank: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x (sorted by expert, `offsets` the cumulative counts) times their expert's
    [out, in] matrix transposed: the op this pass makes of a grouped matmul on a bank."""
    return _grouped_mm(x, bank.transpose(-2, -1), offsets)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    fallback = _grouped_fallback()
    if fallback is not None and not _native_grouped_mm_fits(x, weight):
        return fallback(x, weight, offsets)
    return aten._grouped_mm.default(x, weight, offsets.to(torch.int32))


def _native_grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether aten._grouped_mm runs these tensors (bf16 on CUDA; transformers falls back otherwise)."""
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16


def _grouped_fallback():
    namespace = getattr(torch.ops, "transformers", None)
    return getattr(namespace, "grouped_mm_fallback", None) if namespace is not None else None


def _grouped_targets() -> tuple:
    fallback = _grouped_fallback()
    return (aten._grouped_mm.default,) + ((fallback.default,) if fallback is not None else ())


def canonicalize_linears(gm: fx.GraphModule) -> int:
    """Rewrites `gm`'s products of a value and a 2-D parameter into linear ops in place (node
    names kept, so partition plans still apply); returns how many it rewrote."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        form = _product_form(gm, node) if node.target in _PRODUCTS else None
        if form is None and node.target is aten.einsum.default:
            form = _einsum_form(gm, node)
        if form is None and node.target in _grouped_targets():
            form = _grouped_form(gm, node)
        if form is None:
            continue
        target, x, weight, *rest = form
        replaced = [a for a in node.all_input_nodes if a is not x and a is not weight and a not in rest]
        node.target, node.args, node.kwargs = target, (x, weight, *rest), {}
        for old in replaced:  # the transpose, when nothing else reads it
            if not old.users:
                gm.graph.erase_node(old)
        rewritten += 1
    for node in list(gm.graph.nodes):
        if _is_bias_free_linear(node):
            rewritten += _fold_bias(gm, node)
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _param_2d(gm: fx.GraphModule, node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    value = fetch_attr(gm, node.target)
    return isinstance(value, nn.Parameter) and value.dim() == 2


def _transposed_param(gm: fx.GraphModule, node) -> fx.Node | None:
    """The parameter W when `node` is a transpose of a 2-D parameter, else None."""
    if not isinstance(node, fx.Node) or node.target not in _TRANSPOSES or not _param_2d(gm, node.args[0]):
        return None
    if node.target is aten.transpose.int and {d % 2 for d in node.args[1:3]} != {0, 1}:
        return None
    if node.target is aten.permute.default and [d % 2 for d in node.args[1]] != [1, 0]:
        return None
    return node.args[0]


def _product_form(gm: fx.GraphModule, node: fx.Node):
    """matmul/mm(x, W^T) -> linear(x, W); matmul/mm(x, W) with W [in, out] -> linear_in_out."""
    x, b = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or x.meta["val"].dim() < 1 or _param_2d(gm, x):
        return None
    weight = _transposed_param(gm, b)
    if weight is not None:
        return aten.linear.default, x, weight
    if _param_2d(gm, b):
        return linear_in_out, x, b
    return None


def _grouped_form(gm: fx.GraphModule, node: fx.Node):
    """grouped_mm(x, bank.transpose(-2, -1), offsets) with a 3-D parameter -> grouped_linear."""
    x, weight, offsets = node.args[:3]
    if len(node.args) > 3 or node.kwargs:
        return None
    if not isinstance(weight, fx.Node) or weight.target is not aten.transpose.int:
        return None
    bank = weight.args[0]
    if not isinstance(bank, fx.Node) or bank.op != "get_attr":
        return None
    value = fetch_attr(gm, bank.target)
    if not isinstance(value, nn.Parameter) or value.dim() != 3 or {d % 3 for d in weight.args[1:3]} != {1, 2}:
        return None
    return grouped_linear, x, bank, offsets


def _einsum_form(gm: fx.GraphModule, node: fx.Node):
    """einsum of a value and a 2-D parameter that contracts the value's last dimension with one
    of the weight's and appends the other: "...i,oi->...o" is a linear, "...i,io->...o" one on
    a [in, out] weight (either operand order)."""
    equation, operands = node.args[0], node.args[1]
    if len(operands) != 2 or "." in equation.replace("...", "") or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    for w_index in (0, 1):
        x, weight = operands[1 - w_index], operands[w_index]
        sx, sw = terms[1 - w_index], terms[w_index]
        if not _param_2d(gm, weight) or len(sw) != 2 or not sx or len(set(sx)) != len(sx):
            continue
        contracted, kept = sx[-1], sx[:-1]
        if contracted not in sw or sw[0] == sw[1]:
            continue
        produced = sw.replace(contracted, "")
        if produced in sx or out != kept + produced:
            continue
        return (aten.linear.default if sw[1] == contracted else linear_in_out), x, weight
    return None


def _is_bias_free_linear(node: fx.Node) -> bool:
    return (node.target is aten.linear.default or node.target is linear_in_out) and len(node.args) == 2


def _fold_bias(gm: fx.GraphModule, linear: fx.Node) -> int:
    """`linear(x, W) + b` with b a 1-D parameter of the output features -> linear(x, W, b)."""
    users = list(linear.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or users[0].kwargs.get("alpha", 1) != 1:
        return 0
    add = users[0]
    if len(add.args) != 2:
        return 0
    bias = add.args[1] if add.args[0] is linear else add.args[0]
    if not isinstance(bias, fx.Node) or bias.op != "get_attr":
        return 0
    value, out = fetch_attr(gm, bias.target), linear.meta["val"]
    if not isinstance(value, nn.Parameter) or value.shape != (out.shape[-1],) or value.dtype != out.dtype:
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if order[bias] > order[linear]:
        linear.prepend(bias)  # a get_attr reads no value: it may move up to its new reader
    linear.args = (*linear.args, bias)
    linear.meta["val"] = add.meta["val"]
    add.replace_all_uses_with(linear)
    gm.graph.erase_node(add)
    return 1
