"""A model's linear products for a few rows at a time on a CPU, held beside the model, never in it.

Why: a verify forward multiplies a few rows (the draft tokens) by every weight of the target, and a
draft level the drafter's. On a CPU torch sends an fp32 product of 2-16 rows to MKL's small-M GEMM,
which costs more than a one-row step although a step is bound by streaming the weights from memory.
Two ways stream them at the memory's rate: the rows kernel on the weights as they are (on an AVX-512
CPU, rows.py: nothing to copy), and oneDNN's inner product over a copy of the weights reordered into
its blocked layout (a second copy of every linear weight for as long as the products are held, one
`generate` call or a `hold_products` block). Which serves which row count is measured (routes.py).
Linear layers of one module that read the same input (q/k/v, gate/up) are one product: each
oneDNN product has a fixed cost beside its bytes.

The model is only read: its weights, hooks and forwards stay as they are, and a forward uses the
products only where this call asks for them (the lean forward and the drafter take them by name; a
transformers forward runs under `ProductsMode`, which this thread alone enters). So an interrupt at
any point, a plain call in another thread, a layer patched by the user or accelerate, a save or a
training step inside a `hold_products` block all meet the model as it is. Held products go stale when
a weight changes, through any path (`Products.fresh` compares what they were made from): they are then
made again. Every change to a thread's state (the products it multiplies by, `ProductsMode` on its mode
stack, a model's held products) is made and undone whole under Ctrl-C (`interrupts.Held`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.utils import output_capturing

from hf_eagle31.backends import fast_bf16
from hf_eagle31.backends.cpu import pages, routes
from hf_eagle31.interrupts import Held

PACKED_DTYPES = (torch.float32, torch.bfloat16)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a module's linears that read one input


def rows_layout(dtype: torch.dtype) -> bool:
    """Whether `dtype` products run on the weights as they are (the rows kernel, or torch's product), with no
    oneDNN copy to make: where no row count is measured fastest on oneDNN's (routes.py)."""
    return not routes.copies(dtype)


def can_pack(model: nn.Module) -> bool:
    """Whether the model's products can be held here: a CPU model in fp32 or bf16 (where oneDNN runs bf16, or the
    rows kernel multiplies it: rows.py) whose weights are all in memory (not offloaded by accelerate, which moves
    them in and out around each forward)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    if getattr(model, "is_quantized", False) or not torch.backends.mkldnn.is_available():
        return False
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return False
    return weight.dtype != torch.bfloat16 or fast_bf16(weight.device) or "rows" in routes.available(torch.bfloat16)


_KEYS = itertools.count(1)
_KEY_OF: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def product_key(linear: nn.Module) -> int:
    """The key of the product `linear` leads: drawn at its first packing and kept for the module's life, so every
    packing of a model uses the same keys, and so does every process that packs its models in the same order.

    Why: a compiled verify forward names its products by these keys, as constants (lean.product_keys). With the
    modules' ids as keys each process compiled another graph, and inductor's cache never found the last one
    (minutes of compiling at the first call of every process). A copied module (`copy.deepcopy`) draws its own key.
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
    versions: tuple[tuple, ...]  # each weight's `_made_from` then
    sums: tuple[int, ...] = ()  # with `held`: the `checksum` of each tensor this product copied (`copies`)
    pending: tuple | None = None  # (input, its version, the outputs not yet taken)

    def holds(self, member: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `weight` and `bias` are still the tensors member `member` was made from, in the same memory, not
        changed through themselves (their version counters): checked at each product a transformers forward asks
        for, so cheap. A change through another view of the memory is `checked` once per call instead."""
        return weight is self.members[member] and _made_from(weight) == self.versions[member] and \
            bias is self.biases[member]

    def copies(self) -> list[torch.Tensor]:
        """The model's tensors this product computes with a copy of: the weights reordered for oneDNN, the biases
        stacked (the rows kernel reads the weights themselves)."""
        weights = list(self.members) if self.weight is not None else []
        stacked = len(self.members) > 1 and self.biases[0] is not None
        return weights + (list(self.biases) if stacked else [])

    def checked(self) -> bool:
        """Whether the model's tensors still hold what this product's copies were made from, bit for bit (`checksum`):
        an edit through `.data`, a fused optimizer step or a copy into the memory leaves the version counter as it
        was."""
        return tuple(map(checksum, self.copies())) == self.sums

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


def stacked_bias(biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """The members' biases as their one product adds them: none, the lone member's, or side by side."""
    return biases[0] if len(biases) == 1 or biases[0] is None else torch.cat([b.detach() for b in biases])


def _made_from(weight: torch.Tensor) -> tuple:
    return weight._version, weight.data_ptr(), weight.dtype, weight.shape, weight.stride()


@torch.no_grad()
def checksum(tensor: torch.Tensor) -> int:
    """The wrapping sum of a tensor's bytes read as 32-bit words: any change to one element changes it, and it
    streams at about the memory's rate (an integer sum, the same in any order and on any thread count)."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    whole = raw.numel() // 4 * 4
    words = raw[:whole] if raw.storage_offset() % 4 == 0 else raw[:whole].clone()
    return int(torch.sum(words.view(torch.int32), dtype=torch.int32)) + int(raw[whole:].sum())


@torch.inference_mode(False)
@torch.no_grad()
def _pack(members: list[nn.Linear], held: bool) -> Product:
    weights, biases = tuple(m.weight for m in members), tuple(m.bias for m in members)
    bias = stacked_bias(biases)
    sizes, versions, key = [w.shape[0] for w in weights], tuple(map(_made_from, weights)), product_key(members[0])
    packed = None
    if not rows_layout(weights[0].dtype):
        stacked = weights[0].detach() if len(members) == 1 else torch.cat([w.detach() for w in weights])
        packed = torch.ops.mkldnn._reorder_linear_weight(stacked.contiguous(), routes.BATCH_HINT)
    product = Product(packed, bias, sizes, key, weights, biases, versions)
    if held:
        product.sums = tuple(map(checksum, product.copies()))
    return product


def no_hooks(module: nn.Module) -> bool:
    """No hooks but transformers' output capturing ones, which record only inside a transformers forward that asks
    for hidden states (transformers installs them for good at the first such forward)."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return all(hook.__module__ == output_capturing.__name__ for hook in hooks)


def quiet(module: nn.Module) -> bool:
    """Calling the module runs exactly its class's forward: no hooks (`no_hooks`), no forward set on the instance."""
    return no_hooks(module) and "forward" not in vars(module)


def _plain(tensor: torch.Tensor | None) -> bool:
    """A tensor whose `F.linear` is torch's own (not a subclass that multiplies its own way: a fake-quantized or
    wrapped weight), laid out as the products read it."""
    return tensor is None or (type(tensor) in (nn.Parameter, torch.Tensor) and tensor.is_contiguous())


def packable(module: nn.Module) -> bool:
    """A layer whose product computes what its own call computes: torch's `nn.Linear` on plain, contiguous CPU
    weights of a packed dtype. Any other layer runs as a module."""
    return type(module) is nn.Linear and module.weight.dtype in PACKED_DTYPES and \
        module.weight.device.type == "cpu" and _plain(module.weight) and _plain(module.bias) and \
        (module.bias is None or module.bias.dtype == module.weight.dtype)


def _groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The linear layers to hold products of: siblings that read one input together (`SIBLINGS`), others alone."""
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
    """The products of one model's linear layers (`Product`), made from its weights and held here, not in it.
    `held`: they may serve later calls (`hold_products`), so they remember what they copied (`Product.checked`)."""

    def __init__(self, model: nn.Module, held: bool = False):
        self.by_layer: dict[int, tuple[nn.Linear, Product, int]] = {}  # id(layer) -> (layer, product, member)
        self.by_weight: dict[int, tuple[Product, int]] = {}  # id(weight) -> (product, member): `ProductsMode`
        self.by_key: dict[int, Product] = {}
        for members in _groups(model):
            product = _pack(members, held)
            self.by_key[product.key] = product
            for index, layer in enumerate(members):
                self.by_layer[id(layer)] = (layer, product, index)
                self.by_weight[id(layer.weight)] = (product, index)
        pages.collapse(layer.weight for layer, _, _ in self.by_layer.values())  # each step streams them (pages.py)

    def fresh(self) -> bool:
        """Whether every layer still holds the weights its product was made from, unchanged by any path (checked per
        call: one pass over the tensors the products copied)."""
        return all(product.holds(index, layer.weight, layer.bias) and packable(layer)
                   for layer, product, index in self.by_layer.values()) and \
            all(product.checked() for product in self.by_key.values())

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

    def active(self, mode: bool = False) -> Held:
        """These products answer `packed_product` in this thread (the lean forward's products, by key), and with
        `mode` also `F.linear` on the model's weights (`ProductsMode`: a transformers forward's)."""
        return Held(*_activation(self, ProductsMode(self) if mode else None))


def _activation(products: Products | None, mode: TorchFunctionMode | None) -> tuple:
    """`products` made this thread's and `mode` pushed on its mode stack, and the undo of both (`Held`'s pair)."""
    previous = []

    def apply():
        previous.append(getattr(_ACTIVE, "products", None))
        _ACTIVE.products = products or previous[0]
        if mode is not None:
            try:
                mode.__enter__()
            except BaseException:
                _ACTIVE.products = previous[0]
                raise

    def undo():
        if mode is not None:
            mode.__exit__(None, None, None)
        _ACTIVE.products = previous[0]

    return apply, undo


def products_mode(products: Products) -> Held:
    """`ProductsMode` on this thread's mode stack for a block, pushed and popped whole under Ctrl-C."""
    return Held(*_activation(None, ProductsMode(products)))


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
# dispatcher at every product, and `custom_op`'s Python layers (autograd, aliasing checks) cost several times the
# dispatcher's own call under no_grad, at each of a forward's products.
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


def _held(model: nn.Module) -> Products | None:
    with _HELD_LOCK:
        held = _HELD.get(model)
        return None if held is None else held[1]


def products_for(model: nn.Module) -> Products:
    """The model's products for one call: those a `hold_products` block holds while they are fresh, else new ones:
    the block's from then on, or the call's own outside a block."""
    held = _held(model)
    if held is not None and held.fresh():
        return held
    products = Products(model, held=held is not None)
    if held is not None:
        with _HELD_LOCK:
            entry = _HELD.get(model)
            if entry is not None and entry[1] is held:
                entry[1] = products
    return products


def hold_products(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Hold the model's products for the block, so that the EAGLE calls inside do not each make their own. Each
    EAGLE `generate` call otherwise makes them for itself (oneDNN's copies of the weights, a fixed time a call;
    nothing where the rows kernel reads the weights as they are); a serving loop pays that once:

        with hold_products(target), hold_products(drafter):
            for prompt in prompts:
                target.generate(prompt, assistant_model=drafter)

    The model itself is not changed: inside, it saves, copies, moves and trains as outside, and plain calls run
    as they would. Memory: a second copy of its linear weights where they are reordered for oneDNN (`rows_layout`),
    none on the rows kernel. A weight changed inside, by any path, makes the next call make them again (each call
    compares them with the weights: one pass over the copied ones)."""
    if not (enabled and can_pack(model)):
        return contextlib.nullcontext()
    held = _held(model)
    products = held if held is not None and held.fresh() else Products(model, held=True)  # made before any is held

    def hold():
        with _HELD_LOCK:
            entry = _HELD.setdefault(model, [0, products])
            entry[0] += 1
            if entry[1] is held:  # unless another thread refreshed them meanwhile
                entry[1] = products

    def release():
        with _HELD_LOCK:
            entry = _HELD[model]
            entry[0] -= 1
            if not entry[0]:
                del _HELD[model]

    return Held(hold, release)


def packed_weights(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager:
    """`hold_products`' old name, kept until hf_eagle31 0.2."""
    warnings.warn("hf_eagle31.packed_weights is now called hf_eagle31.hold_products, the same context; the old name "
                  "goes in hf_eagle31 0.2: use hold_products", FutureWarning, stacklevel=2)
    return hold_products(model, enabled)
