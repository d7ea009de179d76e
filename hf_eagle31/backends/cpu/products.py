"""A model's linear products for a few rows at a time on a CPU, held beside the model, never in it.

Why: a verify forward multiplies a few rows (the draft tokens) by every weight of the target, and a
draft level the drafter's. On a CPU torch sends an fp32 product of 2-16 rows to MKL's small-M GEMM,
which costs 1.3-1.9 one-row steps although a step is bound by streaming the weights from memory.
Two ways stream them at the memory's rate: the rows kernel on the weights as they are (on an AVX-512
CPU, rows.py: nothing to copy), and oneDNN's inner product over a copy of the weights reordered into
its blocked layout (a second copy of every linear weight for as long as the products are held, one
`generate` call or a `packed_weights` block). Which serves which row count is measured (routes.py).
Linear layers of one module that read the same input (q/k/v, gate/up) are one product: each
oneDNN product has a fixed cost beside its bytes (2.5 ms of a 39 ms fp32 verify forward of SmolLM2).

The model is only read: its weights, hooks and forwards stay as they are, and a forward uses the
products only where this call asks for them (the lean forward and the drafter take them by name; a
transformers forward runs under `ProductsMode`, which this thread alone enters). So an interrupt at
any point, a plain call in another thread, a layer patched by the user or accelerate, a save or a
training step inside a `packed_weights` block all meet the model as it is. Products go stale when a
weight changes (`fresh`): they are then built again, or not used.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.utils import output_capturing

from hf_eagle31.backends import fast_bf16
from hf_eagle31.backends.cpu import routes

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 8  # rows oneDNN lays the weights out for: a verify block's size
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a module's linears that read one input


def rows_layout(dtype: torch.dtype) -> bool:
    """Whether `dtype` products run on the weights as they are (the rows kernel, or torch's product), with no
    oneDNN copy to make: where no row count is measured fastest on oneDNN's (routes.py)."""
    return not routes.copies(dtype)


def can_pack(model: nn.Module) -> bool:
    """Whether the model's products can be held here: a CPU model in fp32 or bf16 (where oneDNN runs bf16) whose
    weights are all in memory (not offloaded by accelerate, which moves them in and out around each forward)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    if getattr(model, "is_quantized", False) or not torch.backends.mkldnn.is_available():
        return False
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return False
    return weight.dtype != torch.bfloat16 or fast_bf16(weight.device)


_KEYS = itertools.count(1)
_KEY_OF: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def product_key(linear: nn.Module) -> int:
    """The key of the product `linear` leads: drawn at its first packing and kept for the module's life, so every
    packing of a model uses the same keys, and so does every process that packs its models in the same order.

    Why: a compiled verify forward names its products by these keys, as constants (lean.product_keys). With the
    modules' ids as keys each process compiled another graph, and inductor's cache never found the last one
    (SmolLM2: ~110 s at the first call of every process). A copied module (`copy.deepcopy`) draws its own key.
    """
    key = _KEY_OF.get(linear)
    if key is None:
        key = _KEY_OF[linear] = next(_KEYS)
    return key


@dataclass(eq=False)
class Product:
    """Linear layers of one module that read the same input (q/k/v, gate/up) as one product, or a lone layer.
    The first member asked for with an input computes every member's output; the others, asked with the same
    input, take theirs (transformers' forward asks for them one at a time)."""

    weight: torch.Tensor | None  # the members' weights stacked, reordered for oneDNN; None: not needed
    bias: torch.Tensor | None  # the members' biases stacked
    sizes: list[int]  # each member's output features
    key: int  # the first member's `product_key`
    members: tuple[nn.Parameter, ...]  # the members' own weights, as they were when packed
    biases: tuple[nn.Parameter | None, ...]  # and biases
    versions: tuple[int, ...]  # the weights' version counters then: a weight changed in place makes it stale
    pending: tuple | None = None  # (input, its version, the outputs not yet taken)

    def holds(self, member: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `weight` and `bias` are still what member `member` was made from: the same tensors, unchanged."""
        return weight is self.members[member] and weight._version == self.versions[member] and \
            bias is self.biases[member]

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output, side by side in the last dimension: the one product."""
        if torch.compiler.is_compiling():
            return packed_product(self.key, x, sum(self.sizes))
        return routes.linear(x, self.members, self.bias, self.weight)

    def product(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """One member's output; the first asked computes all (a call in another thread meanwhile may replace
        `pending`, and then this one computes again)."""
        if len(self.sizes) == 1:
            return self.whole(x)
        pending = self.pending
        version = None if x.is_inference() else x._version  # changed in place since? (inference tensors keep no count)
        if pending is None or pending[0] is not x or pending[1] != version or pending[2][member] is None:
            out = self.whole(x)
            pending = self.pending = (x, version, list(out.split(self.sizes, dim=-1)))
        out, pending[2][member] = pending[2][member], None
        if all(o is None for o in pending[2]):
            self.pending = None  # all taken: no activations held between forwards
        return out


@torch.inference_mode(False)
@torch.no_grad()
def _pack(members: list[nn.Linear]) -> Product:
    weights, biases = tuple(m.weight for m in members), tuple(m.bias for m in members)
    bias = biases[0] if len(members) == 1 or biases[0] is None else torch.cat([b.detach() for b in biases])
    sizes, versions, key = [w.shape[0] for w in weights], tuple(w._version for w in weights), product_key(members[0])
    if rows_layout(weights[0].dtype):
        return Product(None, bias, sizes, key, weights, biases, versions)
    stacked = weights[0].detach() if len(members) == 1 else torch.cat([w.detach() for w in weights])
    packed = torch.ops.mkldnn._reorder_linear_weight(stacked.contiguous(), BATCH_HINT)
    return Product(packed, bias, sizes, key, weights, biases, versions)


def no_hooks(module: nn.Module) -> bool:
    """No hooks but transformers' output capturing ones, which record only inside a transformers forward that asks
    for hidden states (transformers installs them for good at the first such forward)."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return all(hook.__module__ == output_capturing.__name__ for hook in hooks)


def quiet(module: nn.Module) -> bool:
    """Calling the module runs exactly its class's forward: no hooks (`no_hooks`), no forward set on the instance."""
    return no_hooks(module) and "forward" not in vars(module)


def _groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The linear layers to hold products of: siblings that read one input together (`SIBLINGS`), others alone."""
    def packable(module) -> bool:
        return type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES and module.weight.device.type == "cpu"

    groups, grouped = [], set()
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if all(packable(m) for m in members) and len({(m.in_features, m.weight.dtype, m.bias is None)
                                                          for m in members}) == 1:
                groups.append(members)
                grouped.update(map(id, members))
    return groups + [[m] for m in model.modules() if packable(m) and id(m) not in grouped]


class Products:
    """The products of one model's linear layers (`Product`), made from its weights and held here, not in it."""

    def __init__(self, model: nn.Module):
        self.by_layer: dict[int, tuple[nn.Linear, Product, int]] = {}  # id(layer) -> (layer, product, member)
        self.by_weight: dict[int, tuple[Product, int]] = {}  # id(weight) -> (product, member): `ProductsMode`
        self.by_key: dict[int, Product] = {}
        for members in _groups(model):
            product = _pack(members)
            self.by_key[product.key] = product
            for index, layer in enumerate(members):
                self.by_layer[id(layer)] = (layer, product, index)
                self.by_weight[id(layer.weight)] = (product, index)

    def fresh(self) -> bool:
        """Whether every layer still holds the weight its product was made from (not moved, converted or changed)."""
        return all(product.holds(index, layer.weight, layer.bias) for layer, product, index in self.by_layer.values())

    def of(self, *layers: nn.Linear) -> Product | None:
        """The product that computes exactly these layers, in this order, as their own calls would; None where
        there is none, or where a layer's call would do more (a hook, a forward of its own: an adapter's)."""
        entries = [self.by_layer.get(id(layer)) for layer in layers]
        if any(entry is None or entry[0] is not layer for entry, layer in zip(entries, layers)):
            return None
        product = entries[0][1]
        if len(product.sizes) != len(layers) or any(entry[1] is not product or entry[2] != index
                                                    for index, entry in enumerate(entries)):
            return None
        return product if all(map(quiet, layers)) else None

    def __call__(self, x: torch.Tensor, *layers: nn.Linear) -> torch.Tensor | None:
        """The layers' outputs side by side, from their one product; None where they have none (`of`)."""
        product = self.of(*layers)
        return None if product is None else product.whole(x)

    @contextlib.contextmanager
    def active(self, mode: bool = False):
        """These products answer `packed_product` in this thread (the lean forward's products, by key), and with
        `mode` also `F.linear` on the model's weights (`ProductsMode`: a transformers forward's)."""
        previous = getattr(_ACTIVE, "products", None)
        _ACTIVE.products = self
        try:
            with ProductsMode(self) if mode else contextlib.nullcontext():
                yield
        finally:
            _ACTIVE.products = previous


class ProductsMode(TorchFunctionMode):
    """In a transformers forward of the model: `F.linear` on a weight the products hold is computed by its product.
    The layer's own forward still runs (hooks, adapters, a user's patch); only the multiplication by that exact
    weight, unchanged, is taken from the product. Entered per thread: other threads' forwards never see it."""

    def __init__(self, products: Products):
        super().__init__()
        self.by_weight = products.by_weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            entry = self.by_weight.get(id(weight))
            if entry is not None and entry[0].holds(entry[1], weight, args[2] if len(args) > 2 else kwargs.get("bias")):
                return entry[0].product(args[0] if args else kwargs["input"], entry[1])
        return func(*args, **kwargs)


_ACTIVE = threading.local()  # this thread's `Products.active`, for the compiled forward's `packed_linear` op

# A product as one opaque op, so that torch.compile traces around it (a packed weight is an mkldnn tensor, which it
# cannot trace). Defined with `torch.library.Library`, not `custom_op`: a compiled graph calls it back through the
# dispatcher at every product, and `custom_op`'s Python layers (autograd, aliasing checks) cost ~13 us a call under
# no_grad, 2.3 ms of a 20 ms bf16 verify forward of SmolLM2 (120 products) against ~2 us.
_LIBRARY = torch.library.Library("hf_eagle31", "DEF")
_LIBRARY.define("packed_linear(Tensor x, SymInt key, SymInt out_features) -> Tensor")
_LIBRARY.impl("packed_linear", lambda x, key, out_features: packed_product(key, x, out_features), "CPU")


@torch.library.register_fake("hf_eagle31::packed_linear")
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def active_products() -> Products:
    """This thread's products (`Products.active`)."""
    return _ACTIVE.products


def packed_product(key: int, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """The product under `key` (its first member's `product_key`) of this thread's active products; under
    torch.compile the op `hf_eagle31::packed_linear` (which runs this). A key is a module's, so a compiled graph holds
    it as a constant that names the weights of every later packing of the same model too."""
    if torch.compiler.is_compiling():
        return torch.ops.hf_eagle31.packed_linear(x, key, out_features)
    return _ACTIVE.products.by_key[key].whole(x)


_HELD: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()  # model -> [blocks open, Products]
_HELD_LOCK = threading.Lock()


def products_for(model: nn.Module) -> Products:
    """The model's products for one call: those a `packed_weights` block holds while they are fresh, else new ones
    (the call's own, gone with it)."""
    with _HELD_LOCK:
        held = _HELD.get(model)
    if held is not None and held[1].fresh():
        return held[1]
    return Products(model)


@contextlib.contextmanager
def packed_weights(model: nn.Module, enabled: bool = True):
    """Hold the model's products for the block, so that the EAGLE calls inside do not each make their own. Each
    EAGLE `generate` call otherwise makes them for itself (oneDNN's copies: about 0.15-0.2 s for SmolLM2-135M in bf16
    on 2 cores; nothing where the rows kernel reads the weights as they are); a serving loop pays that once:

        with packed_weights(target), packed_weights(drafter):
            for prompt in prompts:
                target.generate(prompt, assistant_model=drafter)

    The model itself is not changed: inside, it saves, copies, moves and trains as outside, and plain calls run
    as they would. Memory: a second copy of its linear weights where they are reordered for oneDNN (`rows_layout`),
    none on the rows kernel. A weight changed inside makes the calls after it make their own."""
    if not (enabled and can_pack(model)):
        yield
        return
    with _HELD_LOCK:
        held = _HELD.setdefault(model, [0, None])
        if held[1] is None or not held[1].fresh():
            held[1] = Products(model)
        held[0] += 1
    try:
        yield
    finally:
        with _HELD_LOCK:
            held[0] -= 1
            if not held[0]:
                _HELD.pop(model, None)
