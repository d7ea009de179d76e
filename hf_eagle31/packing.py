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
weight at most (for a moment, while packing and unpacking: a tied LM head's, 113 MB for SmolLM2 in
fp32, 671 MB for Gemma 3), and plain decoding outside EAGLE runs on the target's own weights, untouched.
An LM head tied to the embedding is packed too, and the embedding reads its rows straight from the
packed memory (`PackedRows`): the layout is a fixed permutation, found once per shape by packing probe
weights, so a row is a gather of known offsets and no second copy is held. SmolLM2's head, 7-10
rows: 6.0 -> 3.8-4.2 ms in fp32, 4.8 -> 1.5-1.9 ms in bf16; Gemma 3's 262k-token head 36 -> 20-24
and 31 -> 11-13 ms (2-core CPU). A weight shared otherwise stays as it is, and its product is taken
transposed, `(W @ x^T)^T`, the weight's rows being the product's batch: a tall weight times a few
columns runs at the memory's rate where a few rows times it run slowly. In fp32 MKL does that best
for 2-4 rows and oneDNN for one row and for more than 4. Under torch.compile a packed product is an
opaque op (`hf_eagle31::packed_linear`), which dynamo calls without tracing into the packed weight (an
mkldnn tensor it cannot trace).

fp32 weights on a CPU with AVX-512 are not reordered at all (`rows_layout`): a group keeps its members'
own weights and multiplies them with the rows kernel (kernels/rows_linear.py), faster than oneDNN's
packed product for 2-16 rows on a 2-core Xeon and without a reorder before and after each call.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import itertools
import threading
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hf_eagle31 import verification  # its `exact_mode_active` (modeling imports this module: a cycle Python resolves)
from hf_eagle31.kernels.rows_linear import rows_kernel, rows_linear

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 8  # rows oneDNN lays the weights out for: a verify block's size
SMALL_TRANSPOSED = 4  # up to this many rows (from 2) MKL multiplies a tied fp32 weight transposed faster than oneDNN


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 products run at full speed on `device`: CUDA, or a CPU where oneDNN computes bf16 (AVX-512)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def rows_layout(dtype: torch.dtype) -> bool:
    """Whether a packing of `dtype` weights leaves them as they are for the rows kernel (kernels/rows_linear.py):
    fp32 where the kernel builds (a CPU with AVX-512). Why: it multiplies 2-16 rows at ~1.1-1.5 one-row products
    where oneDNN's packed layout takes ~1.3-1.9 on a 2-core Xeon, and packs nothing: no reorder before and after a
    call (0.26 s of each SmolLM2 call in fp32), the target's weights readable throughout. bf16 stays with oneDNN,
    whose packed bf16 products run on AMX or AVX-512 BF16."""
    return dtype == torch.float32 and rows_kernel()


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

    weight: torch.Tensor | None  # the members' weights stacked, packed; None where the rows kernel reads `members`
    bias: torch.Tensor | None
    sizes: list[int]  # each member's output features
    key: int  # the first member's `product_key`: the same for every packing of a model, so a compiled graph can name it
    members: tuple[torch.Tensor, ...] = ()  # the members' own weights, for the rows kernel (`rows_layout`)
    pending: tuple | None = None  # (input, its version, the outputs not yet taken)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output, side by side in the last dimension: the one product. Eager calls take it with the
        group's own weight, not through `packed_product`'s key: another thread may unpack the model meanwhile."""
        if torch.compiler.is_compiling():
            return packed_product(self.key, x, sum(self.sizes))
        if self.members:
            return rows_linear(x, self.members, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def member_weight(self, member: int) -> torch.Tensor:
        """A member's weight in torch's layout (a copy where it is packed)."""
        return self.members[member] if self.members else self.weight.to_dense().split(self.sizes)[member]

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


_PACKED_GROUPS: dict[int, PackedGroup] = {}  # key -> the group packed under it now, for `packed_product`
_KEYS = itertools.count(1)


def product_key(linear: nn.Module) -> int:
    """The key of the packed product `linear` leads: a number drawn at its first packing and kept on the module, so
    every packing of a model uses the same keys, and so does every process that packs its models in the same order.

    Why: a compiled verify forward names its products by these keys, as constants (llama_verify.product_keys). With
    the modules' ids as keys each process compiled another graph, and inductor's cache never found the last one
    (SmolLM2: ~110 s at the first call of every process). A module copied (`copy.deepcopy`) draws its own key.
    """
    owner, key = vars(linear).get("product_key", (None, None))
    if owner != id(linear):
        key = next(_KEYS)
        vars(linear)["product_key"] = (id(linear), key)
    return key

# A packed product as one opaque op, so that torch.compile traces around it (a packed weight is an mkldnn tensor,
# which it cannot trace). Defined with `torch.library.Library`, not `custom_op`: a compiled graph calls it back
# through the dispatcher at every product, and `custom_op`'s Python layers (autograd, aliasing checks) cost ~13 us a
# call under no_grad, 2.3 ms of a 20 ms bf16 verify forward of SmolLM2 (120 products) against ~2 us.
_LIBRARY = torch.library.Library("hf_eagle31", "DEF")
_LIBRARY.define("packed_linear(Tensor x, SymInt key, SymInt out_features) -> Tensor")
_LIBRARY.impl("packed_linear", lambda x, key, out_features: packed_product(key, x, out_features), "CPU")


@torch.library.register_fake("hf_eagle31::packed_linear")
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def packed_product(key: int, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """The product of the `PackedGroup` packed under `key` (its first member's `product_key`), under torch.compile the
    op `hf_eagle31::packed_linear` (which runs this). A key is a module's, not the group's, so a compiled graph holds
    it as a constant that names the weights of every later packing of the same model too (the graph is guarded on the
    model), and its C++ wrapper takes no Python int per product."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_eagle31.packed_linear(x, key, out_features)
    return _PACKED_GROUPS[key].whole(x)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    group, member = vars(self).get("packed"), vars(self).get("packed_member")
    if group is None or member is None:  # unpacked by another thread while an "exact" call (which holds no
        return F.linear(x, self.weight, self.bias)  # packing) was on its way here: the weight is back by then
    if torch.compiler.is_compiling():  # each member takes its slice of the whole product (dynamo traces no `pending`)
        return group.whole(x).split(group.sizes, dim=-1)[member]
    if verification.exact_mode_active():  # a concurrent "exact" call on this target computes on the plain weight
        return F.linear(x, group.member_weight(member), self.bias)
    return group.product(x, member)


def one_product(*members: nn.Linear) -> PackedGroup | None:
    """The group that packs exactly `members`, in this order, as one product; None where they are not."""
    group = vars(members[0]).get("packed")
    if group is None or len(group.sizes) != len(members) or not all(
            vars(member).get("packed") is group and vars(member).get("packed_member") == index
            for index, member in enumerate(members)):
        return None
    return group


def sibling_products(x: torch.Tensor, *members: nn.Linear) -> torch.Tensor:
    """The outputs of linear layers that read `x` (q/k/v, gate/up), side by side in the last dimension.

    Why: where they are packed together (`PackedGroup`) that is their one product, taken without the module calls
    and the hand-over between members (with the drafter's rotary table, 2.5% of a bf16 draft tree of SmolLM2's
    drafter on 2 threads); else each layer's own call (hooks, adapters and all), concatenated.
    """
    group = one_product(*members)
    hooked = any(member._forward_hooks or member._forward_pre_hooks for member in members)
    if group is None or hooked or verification.exact_mode_active():
        return torch.cat([member(x) for member in members], dim=-1)
    return group.whole(x)


def _transposed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if verification.exact_mode_active():
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


def _memory_of(packed: torch.Tensor) -> torch.Tensor:
    """A packed (mkldnn) weight's memory as a flat tensor of its dtype, valid while `packed` lives."""
    buffer = (ctypes.c_char * torch.ops.mkldnn._nbytes(packed)).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(buffer, dtype=packed.dtype)


PROBE_ROWS = 4096  # rows of the weights that probe a packed layout: 9-10 MB for SmolLM2's and Gemma's heads


def _probed_layout(shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where column 0's and row 0's elements land in a packed weight of `shape`, from probe weights that carry
    each index there (column 0 positive, row 0 negative) in digits exact in the dtype (base 2^24 in fp32, 256 in
    bf16), zeros elsewhere; None where the probe's nonzeros are not one each."""
    rows, columns = shape
    base = 256 if dtype == torch.bfloat16 else 2 ** 24
    index, scale = torch.zeros(rows + columns - 1, dtype=torch.long), 1
    while True:
        probe = torch.zeros(shape, dtype=dtype)
        probe[:, 0] = torch.arange(rows) // scale % base + 1
        probe[0, 1:] = -(torch.arange(1, columns) // scale % base + 1)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, BATCH_HINT)
        memory = _memory_of(packed)
        places = memory.nonzero().squeeze(1)
        if places.numel() != index.numel():
            return None
        digits = memory[places].long()
        index += (digits.abs() - 1) * scale
        scale *= base
        if scale >= max(shape):
            break
    in_column = digits > 0  # the last probe's signs tell the two sets apart
    starts, offsets = torch.empty(rows, dtype=torch.long), torch.empty(columns, dtype=torch.long)
    starts[index[in_column]] = places[in_column]
    offsets[index[~in_column]] = places[~in_column]
    offsets[0] = starts[0]
    return starts - starts[0], offsets


@functools.cache
def _row_layout(shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Element (r, c) of a packed weight of `shape` at `starts[r] + offsets[c]` of its memory, or None where
    the probes find no such layout. A blocked layout splits so (each dimension's block indices add their own
    strides), and repeats every block of rows: probing the first `PROBE_ROWS` rows gives the rest, so the
    probes stay small (a full-size probe of Gemma's head would take 1.3 GB). Found once a process per shape;
    `pack_linears` checks it on rows of the real weight, the last ones included."""
    rows, columns = shape
    probed = _probed_layout((min(rows, PROBE_ROWS), columns), dtype)
    if probed is None or rows <= PROBE_ROWS:
        return probed
    starts, offsets = probed
    steps = starts.diff()
    jumps = (steps != steps[0]).nonzero()
    period = int(jumps[0, 0]) + 1 if len(jumps) else 1  # rows in a block: where the first jump is
    shifted = starts[period:] - starts[:-period]
    if 2 * period > len(starts) or not bool((shifted == starts[period]).all()):  # not one block repeated
        return None
    every = torch.arange(rows)
    return every // period * starts[period] + starts[every % period], offsets


@dataclass(eq=False)
class PackedRows:
    """An embedding's rows read from the packed weight of the LM head tied to it (`_row_layout`)."""

    packed: torch.Tensor  # the head's packed weight, kept alive here: `memory` is a view of it
    memory: torch.Tensor = field(init=False)
    starts: torch.Tensor = field(init=False)
    offsets: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.memory = _memory_of(self.packed)
        self.starts, self.offsets = _row_layout(tuple(self.packed.shape), self.packed.dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        places = self.starts.index_select(0, ids.reshape(-1)).unsqueeze(-1) + self.offsets  # index_select: 10x
        return self.memory.index_select(0, places.view(-1)).view(*ids.shape, -1)  # faster than `memory[places]`


class _RowsFromPacked(TorchFunctionMode):
    """Inside an embedding's forward: `F.embedding` of its (packed-out) weight gathers from the packed memory.
    A mode rather than a new forward, so subclasses that scale or pad around `nn.Embedding.forward` keep working."""

    def __init__(self, embedding: nn.Embedding, rows: PackedRows):
        super().__init__()
        self.embedding, self.rows = embedding, rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and (args[1] if len(args) > 1 else kwargs.get("weight")) is self.embedding.weight:
            return self.rows(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)


def _rows_forward(self: nn.Embedding, *args, **kwargs) -> torch.Tensor:
    rows = vars(self).get("packed_rows")
    if rows is None:  # unpacked by another thread meanwhile (see `_packed_forward`): the weight is back
        return type(self).forward(self, *args, **kwargs)
    if type(self).forward is nn.Embedding.forward:  # a plain embedding: its rows, without the mode's ~30 us
        return rows(args[0] if args else kwargs["input"])
    with _RowsFromPacked(self, rows):
        return type(self).forward(self, *args, **kwargs)


def _tied_embeddings(users: dict[int, list[nn.Module]]) -> dict[int, tuple[nn.Embedding, torch.Tensor, torch.Tensor]]:
    """id(head) -> (the embedding, probe ids, its rows for them) for each linear layer whose weight's only other
    user is one embedding (a tied LM head) that the packed memory can serve: its weight's layout splits
    (`_row_layout`), it has no `max_norm` (which renormalises the weight in place) and takes ids alone."""
    ties = {}
    for modules in users.values():
        if len(modules) != 2 or {type(m) is nn.Linear for m in modules} != {True, False}:
            continue
        head, embedding = sorted(modules, key=lambda m: type(m) is not nn.Linear)
        if not (isinstance(embedding, nn.Embedding) and embedding.weight is head.weight and head.bias is None and
                embedding.max_norm is None and head.weight.dtype in PACKED_DTYPES and
                _row_layout(tuple(head.weight.shape), head.weight.dtype) is not None):
            continue
        count = embedding.num_embeddings  # rows to check the layout on: both ends and a spread between
        probe = torch.cat([torch.arange(min(64, count)), torch.arange(max(count - 64, 0), count),
                           torch.randint(count, (256,), generator=torch.Generator().manual_seed(0))]).unique()
        try:
            ties[id(head)] = (embedding, probe, type(embedding).forward(embedding, probe))  # no hooks fired
        except Exception:  # an embedding that wants more than ids: its head is multiplied transposed
            continue
    return ties


def _users(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Each parameter storage of the model -> the modules holding it (two or more: tied weights)."""
    users: dict[int, list[nn.Module]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for parameter in module._parameters.values():
            if parameter is not None:
                users.setdefault(parameter.untyped_storage().data_ptr(), []).append(module)
    return users


def _groups(model: nn.Module, shared: set[int], heads: set[int]) -> list[list[nn.Linear]]:
    """The linear layers to pack (untied ones and the tied `heads`), siblings that read one input together
    (`SIBLINGS`), others alone."""
    def packable(module) -> bool:
        return type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES and \
            (module.weight.untyped_storage().data_ptr() not in shared or id(module) in heads)

    groups, grouped = [], set()
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if all(packable(m) for m in members) and len({(m.in_features, m.weight.dtype, m.bias is None)
                                                          for m in members}) == 1:
                groups.append(members)
                grouped.update(map(id, members))
    return groups + [[m] for m in model.modules() if packable(m) and id(m) not in grouped]


def _nan_like(weight: torch.Tensor) -> torch.Tensor:
    return torch.full((), float("nan"), dtype=weight.dtype).expand(weight.shape)


def _serve_rows(embedding: nn.Embedding, head: nn.Linear, expected: torch.Tensor, probe: torch.Tensor) -> bool:
    """Let the embedding look its rows up in the packed head where that returns what it did before packing; whether
    it does. Tried on a copy whose weight is the NaN stand-in (an embedding that reads its weight other than through
    `F.embedding` gives NaN), so that calls in other threads meanwhile find the embedding as it was."""
    rows, trial = PackedRows(head.packed.weight), copy.copy(embedding)
    trial._parameters = {**embedding._parameters, "weight": _nan_like(embedding.weight)}
    trial.packed_rows = rows
    if not torch.equal(_rows_forward(trial, probe), expected):
        return False
    embedding.packed_rows = rows
    embedding.forward = types.MethodType(_rows_forward, embedding)
    return True


@torch.inference_mode(False)  # a `generate` under inference mode must leave ordinary weights behind
@torch.no_grad()
def pack_linears(model: nn.Module) -> list[nn.Module]:
    """Swap every linear weight of `model` for its packed copy, siblings stacked into one, a tied LM head's
    embedding reading its rows from the head's (other tied weights are multiplied transposed); returns the modules
    changed. A failure on the way gives back the weights swapped so far."""
    users = _users(model)
    shared = {storage for storage, modules in users.items() if len(modules) > 1}
    ties = _tied_embeddings(users)
    swapped = []
    try:
        for module in model.modules():
            if type(module) is nn.Linear and module.weight.untyped_storage().data_ptr() in shared and \
                    id(module) not in ties:
                swapped.append(module)
                module.forward = types.MethodType(_transposed_forward, module)
        for members in _groups(model, shared, set(ties)):
            weights = [m.weight.detach() for m in members]
            bias = members[0].bias if len(members) == 1 or members[0].bias is None else \
                torch.cat([m.bias.detach() for m in members])
            sizes = [w.shape[0] for w in weights]
            if rows_layout(weights[0].dtype):
                group = PackedGroup(None, bias, sizes, product_key(members[0]), tuple(w.contiguous() for w in weights))
            else:
                stacked = weights[0] if len(members) == 1 else torch.cat(weights)
                group = PackedGroup(torch.ops.mkldnn._reorder_linear_weight(stacked, BATCH_HINT), bias, sizes,
                                    product_key(members[0]))
            _PACKED_GROUPS[group.key] = group
            for index, module in enumerate(members):
                swapped.append(module)  # first: whatever happens to it below, unpacking undoes
                module.packed, module.packed_member = group, index
                module.forward = types.MethodType(_packed_forward, module)
            if group.members:  # the weights stay: nothing to serve rows from or to release
                continue
            for head in (m for m in members if id(m) in ties):
                embedding, probe, expected = ties[id(head)]
                swapped.append(embedding)
                if not _serve_rows(embedding, head, expected, probe):
                    unpack_linears([head])  # back to the head's own weight, multiplied transposed
                    head.forward = types.MethodType(_transposed_forward, head)
            for module in members:  # the storage goes once no forward reads it (calls in other threads go on);
                if vars(module).get("packed") is group:  # a NaN of its shape stands in: a read that bypasses
                    module.weight.data = _nan_like(module.weight)  # forward cannot pass unnoticed
    except BaseException:
        unpack_linears(swapped)
        raise
    return swapped


@torch.inference_mode(False)
@torch.no_grad()
def unpack_linears(swapped: list[nn.Module]) -> None:
    """Give each layer its own weight back, reordered from the packed copy (the same values bit for bit)."""
    dense = {}  # id(group) -> its members' weights
    for module in swapped:  # the weight back before the forward: calls in other threads meanwhile read one of them
        group = vars(module).get("packed")
        if group is not None:
            _PACKED_GROUPS.pop(group.key, None)
            if group.weight is not None:  # packed by oneDNN (the rows kernel's weights never left)
                if id(group) not in dense:
                    dense[id(group)] = group.weight.to_dense().split(group.sizes)
                weight = dense[id(group)][module.packed_member]
                module.weight.data = weight if len(group.sizes) == 1 else weight.clone()  # each its own storage
            del module.packed, module.packed_member
        vars(module).pop("forward", None)
        vars(module).pop("packed_rows", None)


def _releases_weights(swapped: list[nn.Module]) -> bool:
    """Whether a packing released weights (oneDNN's layout), which a `state_dict` meanwhile would read as NaN."""
    return any(getattr(vars(m).get("packed"), "weight", None) is not None for m in swapped)


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
    about 0.15-0.2 s for SmolLM2-135M on 2 cores (nothing in fp32 on AVX-512: `rows_layout`); a serving loop pays
    that once by wrapping its calls:

        with packed_weights(target), packed_weights(drafter):
            for prompt in prompts:
                target.generate(prompt, assistant_model=drafter)

    Inside, every forward of `model` runs on the packed weights, plain ones too; where oneDNN's layout released
    them its `state_dict` refuses (the packed-out weights read NaN), so save, move or convert the model outside.
    Threads: a forward running while the last call unpacks computes on the one weight or the other, but one
    running while the first call packs may read a packed-out weight (its memory goes): a server that runs plain
    or "exact" calls beside EAGLE ones packs once around all of them, as above."""
    if not (enabled and can_pack(model)):
        yield
        return
    with _LOCK:
        calls, swapped, hook = _PACKED.get(id(model), (0, [], None))
        if not calls:
            swapped = pack_linears(model)
            hook = model.register_state_dict_pre_hook(_refuse_state_dict) if _releases_weights(swapped) else None
        _PACKED[id(model)] = (calls + 1, swapped, hook)
    try:
        yield
    finally:
        with _LOCK:
            calls, swapped, hook = _PACKED.pop(id(model))
            if calls > 1:
                _PACKED[id(model)] = (calls - 1, swapped, hook)
            else:
                if hook is not None:
                    hook.remove()
                unpack_linears(swapped)
