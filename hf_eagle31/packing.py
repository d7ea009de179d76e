"""The target's linear weights in oneDNN's packed layout while EAGLE decodes on a CPU.

Why: a verify forward multiplies a few rows (the draft tokens) by every weight of the target. On
a CPU torch sends an fp32 product of 2-16 rows to MKL's small-M GEMM, which costs 1.3-1.9 one-row
steps although a step is bound by streaming the weights from memory. oneDNN's inner product over
weights reordered once into its blocked layout (what inductor's freezing and serving engines use)
streams them at the memory's rate, so verifying several tokens costs about one plain step.

The packed layout is a second copy of each weight. Rather than hold both, the target holds the
packed copy *instead* of its own while EAGLE calls run on it: each linear layer's weight is
reordered and its own storage released, and when the last call ends the packed copy is reordered
back, a permutation, so the target gets bit for bit its own weights. Memory grows by one layer's
weight at most, and plain decoding outside EAGLE runs on the target's own weights, untouched.
A weight shared with another module (an LM head tied to the embedding) stays as it is, and its
product is taken transposed, `(W @ x^T)^T`, the weight's rows being the product's batch: a tall
weight times a few columns runs at the memory's rate where a few rows times it run slowly. In fp32
MKL does that best for 2-4 rows (SmolLM2's head: 3-6 ms against 25 ms the plain way, on the 2-core
CPU) and oneDNN for one row and for more than 4 (4.8-7.4 ms for 1-16 rows, where MKL's takes 10 ms
for one and 16-20 ms from 10: the jump that made trees of 10 or more tokens cost 1.5 plain steps). Under torch.compile a packed product is a custom op, which dynamo
calls without tracing into the packed weight (an mkldnn tensor it cannot trace).
"""

from __future__ import annotations

import contextlib
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_eagle31.verification import exact_mode_active

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 8  # rows oneDNN lays the weights out for: a verify block's size
SMALL_TRANSPOSED = 4  # up to this many rows (from 2) MKL multiplies a tied fp32 weight transposed faster than oneDNN


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 products run at full speed on `device`: CUDA, or a CPU where oneDNN computes bf16 (AVX-512)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(model: nn.Module) -> bool:
    """Whether the model's weights can be packed here: a CPU model in fp32 or bf16 (where oneDNN runs bf16)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    if getattr(model, "is_quantized", False) or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or fast_bf16(weight.device)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a module's linears that read one input


@dataclass(eq=False)
class PackedGroup:
    """Linear layers of one module that read the same input (q/k/v, gate/up) packed as one product, or a lone layer.

    Why: each oneDNN product has a fixed cost beside the bytes it streams, so q/k/v in one product and gate/up in
    another save 2.5 ms of a 39 ms fp32 verify forward of SmolLM2 (2 ms in bf16). The first member called with
    an input computes every member's output; the others, called with the same input, take theirs.
    """

    weight: torch.Tensor  # the members' weights stacked, packed
    bias: torch.Tensor | None
    sizes: list[int]  # each member's output features
    pending: tuple | None = None  # (input, its version, the outputs not yet taken)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output, side by side in the last dimension: the one product."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def product(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if len(self.sizes) == 1:
            return self.whole(x)
        pending = self.pending  # read once: a call in another thread may replace it, and then this one recomputes
        version = None if x.is_inference() else x._version  # changed in place since? (inference tensors keep no count)
        if pending is None or pending[0] is not x or pending[1] != version or pending[2][member] is None:
            out = self.whole(x)
            pending = self.pending = (x, version, list(out.split(self.sizes, dim=-1)))
        out, pending[2][member] = pending[2][member], None
        if self.pending is pending and all(o is None for o in pending[2]):
            self.pending = None  # all taken: no activations held between forwards
        return out


_PACKED_BY_ID: dict[int, torch.Tensor] = {}  # id(group) -> its packed weight, for `packed_linear`


@torch.library.custom_op("hf_eagle31::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, group: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """A packed product as one opaque op, so that torch.compile traces around it (a packed weight is an
    mkldnn tensor, which it cannot trace); `group` is the `PackedGroup`'s id."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED_BY_ID[group], bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, group: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    group, member = self.packed, self.packed_member
    if torch.compiler.is_compiling():  # each member takes its slice of the whole product (dynamo traces no `pending`)
        out = packed_linear(x, id(group), sum(group.sizes), group.bias)
        return out.split(group.sizes, dim=-1)[member]
    if exact_mode_active():  # a concurrent "exact" call on this target computes on the plain weight
        return F.linear(x, group.weight.to_dense().split(group.sizes)[member], self.bias)
    return group.product(x, member)


def _transposed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if exact_mode_active():
        return F.linear(x, self.weight, self.bias)
    if self.weight.dtype == torch.float32 and not 2 <= rows.shape[0] <= SMALL_TRANSPOSED and \
            not torch.compiler.is_compiling():
        out = torch.ops.mkldnn._linear_pointwise(self.weight, rows.contiguous(), None, "none", [], "").t()
    elif rows.shape[0] == 1:
        return F.linear(x, self.weight, self.bias)
    else:
        out = torch.mm(self.weight, rows.t()).t()
    out = out.reshape(*x.shape[:-1], -1)
    return out if self.bias is None else out + self.bias


def _shared(model: nn.Module) -> set[int]:
    """Storages that more than one parameter slot of the model points at (tied weights)."""
    seen, shared = set(), set()
    for _, parameter in model.named_parameters(remove_duplicate=False):
        pointer = parameter.untyped_storage().data_ptr()
        (shared if pointer in seen else seen).add(pointer)
    return shared


def _groups(model: nn.Module, shared: set[int]) -> list[list[nn.Linear]]:
    """The untied linear layers to pack, siblings that read one input together (`SIBLINGS`), others alone."""
    def packable(module) -> bool:
        return type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES and \
            module.weight.untyped_storage().data_ptr() not in shared

    groups, grouped = [], set()
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if all(packable(m) for m in members) and len({(m.in_features, m.weight.dtype, m.bias is None)
                                                          for m in members}) == 1:
                groups.append(members)
                grouped.update(map(id, members))
    return groups + [[m] for m in model.modules() if packable(m) and id(m) not in grouped]


@torch.inference_mode(False)  # a `generate` under inference mode must leave ordinary weights behind
@torch.no_grad()
def pack_linears(model: nn.Module) -> list[nn.Linear]:
    """Swap every untied linear weight of `model` for its packed copy, siblings stacked into one (a tied one is
    multiplied transposed); returns the layers changed. A failure on the way gives back the weights swapped so far."""
    shared = _shared(model)
    swapped = []
    try:
        for module in model.modules():
            if type(module) is nn.Linear and module.weight.untyped_storage().data_ptr() in shared:
                swapped.append(module)
                module.forward = types.MethodType(_transposed_forward, module)
        for members in _groups(model, shared):
            weights = [m.weight.detach() for m in members]
            stacked = weights[0] if len(members) == 1 else torch.cat(weights)
            bias = members[0].bias if len(members) == 1 or members[0].bias is None else \
                torch.cat([m.bias.detach() for m in members])
            group = PackedGroup(torch.ops.mkldnn._reorder_linear_weight(stacked, BATCH_HINT), bias,
                                [w.shape[0] for w in weights])
            _PACKED_BY_ID[id(group)] = group.weight
            for index, module in enumerate(members):
                swapped.append(module)  # first: whatever happens to it below, unpacking undoes
                module.packed, module.packed_member = group, index
                # the storage goes; a NaN of the same shape stands in: a read that bypasses forward cannot pass unnoticed
                module.weight.data = torch.full((), float("nan"), dtype=module.weight.dtype).expand(module.weight.shape)
                module.forward = types.MethodType(_packed_forward, module)
    except BaseException:
        unpack_linears(swapped)
        raise
    return swapped


@torch.inference_mode(False)
@torch.no_grad()
def unpack_linears(swapped: list[nn.Linear]) -> None:
    """Give each layer its own weight back, reordered from the packed copy (the same values bit for bit)."""
    dense = {}  # id(group) -> its members' weights
    for module in swapped:
        group = vars(module).pop("packed", None)
        if group is not None:
            if id(group) not in dense:
                dense[id(group)] = group.weight.to_dense().split(group.sizes)
                _PACKED_BY_ID.pop(id(group), None)
            weight = dense[id(group)][module.packed_member]
            module.weight.data = weight if len(group.sizes) == 1 else weight.clone()  # each its own storage
            del module.packed_member
        vars(module).pop("forward", None)


def _refuse_state_dict(module: nn.Module, *_) -> None:
    raise RuntimeError(
        f"{type(module).__name__}'s linear weights are packed for oneDNN (inside hf_eagle31's `packed_weights`), "
        "and NaNs stand in for them: save or copy the model outside that block."
    )


# id(model) -> (calls in flight, layers swapped, the hook refusing state_dict)
_PACKED: dict[int, tuple[int, list[nn.Linear], RemovableHandle | None]] = {}
_LOCK = threading.Lock()


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool = True):
    """`model` on packed weights for the duration (when `enabled` and `can_pack`). Nested and concurrent calls
    share one packing: the first packs and the last one unpacks. Each EAGLE `generate` call packs for itself,
    about 0.2 s for SmolLM2-135M in fp32 on 2 cores; a serving loop pays that once by wrapping its calls:

        with packed_weights(target), packed_weights(drafter):
            for prompt in prompts:
                target.generate(prompt, assistant_model=drafter)

    Inside, every forward of `model` runs on the packed weights, plain ones too; its `state_dict` refuses
    (the packed-out weights read NaN), so save, move or convert the model outside."""
    if not (enabled and can_pack(model)):
        yield
        return
    with _LOCK:
        calls, swapped, hook = _PACKED.get(id(model), (0, [], None))
        if not calls:
            swapped, hook = pack_linears(model), model.register_state_dict_pre_hook(_refuse_state_dict)
        _PACKED[id(model)] = (calls + 1, swapped, hook)
    try:
        yield
    finally:
        with _LOCK:
            calls, swapped, hook = _PACKED.pop(id(model))
            if calls > 1:
                _PACKED[id(model)] = (calls - 1, swapped, hook)
            else:
                hook.remove()
                unpack_linears(swapped)
