"""A Llama-family target's verify forward on the CPU backend's products: transformers' own ops, without its module
dispatch.

Why: on a CPU, transformers' machinery around the products (module calls, keyword plumbing, the attention
interface, output capturing; on the CPU backend also `ProductsMode` seeing every op) is a sizeable share of a
verify step (docs/benchmarks.md). The forward below computes the same
operations in the same order (transformers' own
norm and `rotate_half` in its rotary formula, EAGLE's own attention function) on the same products
and cache, so on torch's ops a verify block's logits, features and cache equal the transformers path's bit for bit
(tests/test_lean.py compares them). It runs only where that holds by construction:
transformers' own Llama, Mistral or Qwen2 classes (one layer design: `FAMILIES`) without sliding
windows, a product for every projection (products.py), no hooks or replaced forwards on the modules it
steps over, dynamic (not sliding, not static) cache layers, a "batched" plan.
Anything else, on any device, runs the target's own forward. Two things are done differently, with the same
numbers: the queries and keys are rotated in one go, and the cache grows in place (`CacheRoom`) instead of by
concatenation. Where the rows library multiplies the forward's rows, attends over heads of its size
(rows_attention.cpp) and the MLPs gate by SiLU, it computes the layers whole (`_whole_step`, rows_step.cpp: the
same operations, sums in another order, its attention a rounding apart from SDPA's), one call instead of ~30
operations a layer: a SmolLM2 one-token step 1.17x faster in fp32 and 1.28x in bf16 than on torch's ops, as fast as
inductor's graph (docs/benchmarks.md). Elsewhere the ops below run (a one-token step still attends on the library
where it can). With `compile_verify` (fast_decoding's `compile_step`) the layers run as one inductor graph
(`compiled_decoder`), with the same numbers but for the order of a few sums.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._dynamo import config as dynamo_config
from torch.fx.experimental import _config as fx_config
from torch.nn.modules import module as torch_module
from transformers import Cache, PreTrainedModel, activations
from transformers.cache_utils import DynamicLayer
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from hf_eagle31 import verification
from hf_eagle31.backends.cpu import routes, rows
from hf_eagle31.backends.cpu.products import (
    Products,
    active_products,
    no_hooks,
    packed_product,
    product_key,
    products_mode,
    quiet,
    stacked_bias,
)
from hf_eagle31.cache import truncate_cache
from hf_eagle31.kernels.tree_attention import grouped_attention
from hf_eagle31.modeling import rotary_rows


@dataclass(frozen=True)
class Family:
    """One architecture's classes and `rotate_half`: the same layer design as Llama's (Qwen2 adds q/k/v biases,
    which the products carry)."""

    layer: type
    attention: type
    mlp: type
    norm: type
    rotate_half: Callable


FAMILIES = {
    llama.LlamaModel: Family(llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm,
                             llama.rotate_half),
    mistral.MistralModel: Family(mistral.MistralDecoderLayer, mistral.MistralAttention, mistral.MistralMLP,
                                 mistral.MistralRMSNorm, mistral.rotate_half),
    qwen2.Qwen2Model: Family(qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm,
                             qwen2.rotate_half),
}


def _window(attention: nn.Module) -> int | None:
    """The sliding window the layer's attention passes on (Qwen2 sets it per layer, Mistral for all)."""
    return getattr(attention, "sliding_window", getattr(attention.config, "sliding_window", None))


def _fits_layer(layer: nn.Module, family: Family, products: Products) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not (type(layer) is family.layer and type(attention) is family.attention and type(mlp) is family.mlp and
            type(layer.input_layernorm) is family.norm and type(layer.post_attention_layernorm) is family.norm and
            isinstance(mlp.act_fn, nn.Module) and _window(attention) is None):
        return False
    # a projection has a product only while it is quiet (`products.of`)
    return (products.of(attention.q_proj, attention.k_proj, attention.v_proj) and products.of(attention.o_proj) and
            products.of(mlp.gate_proj, mlp.up_proj) and products.of(mlp.down_proj) and
            all(map(quiet, (layer, attention, mlp, layer.input_layernorm, layer.post_attention_layernorm,
                            mlp.act_fn))))


def fits(target: PreTrainedModel, products: Products) -> bool:
    """Whether `llama_verify_forward` computes the target's verify forwards on `products` exactly as `target(...)`
    would, where `fits_step` too. Checked once per call: it walks every module (about a millisecond)."""
    model = getattr(target, "model", None)
    family = FAMILIES.get(type(model))
    if target.training or family is None or type(model.norm) is not family.norm or \
            target.config._attn_implementation != verification.ATTENTION_NAME:  # SDPA under EAGLE's attention
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:  # apply to every module
        return False
    if not quiet(target):
        return False
    # the embedding is called as a module, as transformers calls it, so a forward of its own runs the same way in
    # both; hooks are refused on it as on the modules stepped over (the lean forward captures its own features)
    return no_hooks(model.embed_tokens) and all(map(quiet, (model, model.rotary_emb, model.norm))) and \
        all(_fits_layer(layer, family, products) for layer in model.layers)


def fits_step(cache: Cache, plan) -> bool:
    """Whether this verify forward is one `llama_verify_forward` computes: a "batched" plan, dynamic cache layers
    that hold the prompt already."""
    return plan.mode == "batched" and not plan.held and \
        all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)


def _product_members(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """Each layer's four products (q/k/v, o, gate/up, down), in order, as the linear layers in each."""
    members = []
    for layer in model.layers[: model.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        members += [(attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
                    (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
    return members


@torch.compiler.assume_constant_result  # traced, a constant of the graph (the graph is guarded on the modules' ids)
def product_keys(model: nn.Module) -> list[int]:
    """Each layer's four products, in order, as `products.packed_product`'s keys: what `_decoder` multiplies by. A
    key is the first member's `product_key` (`fits` checked that each projection leads its product), the same at
    every packing, so that traced once it is a constant of the compiled graph."""
    return [product_key(members[0]) for members in _product_members(model)]


class CacheRoom:
    """Where one `generate` call's verify forwards grow the target's dynamic cache layers in place, the packed
    products they multiply by (`product_keys`: fixed while the call lasts, so the module lookups that gather them
    run once a call), and whether they run compiled (`compiled_decoder`).

    Why: transformers' `DynamicLayer.update` concatenates, copying every cached key and value of every
    layer at every forward, a cost that grows with the context. Here a layer's keys and values are the front of a
    buffer with room behind them (a sixteenth of the cache, at least `MIN_ROOM` tokens), and a block is
    written into that room. Rolling back (`truncate`, or transformers' `crop`) and compacting (`compact_cache`)
    keep that front view; anything that replaces the tensors (a row leaving the batch, a plain forward's
    concatenation) makes the next block start a new buffer. Buffers belong to one call, so no tensor handed out
    before it (a cache the caller kept, then cropped) can see its writes.
    """

    MIN_ROOM = 64

    def __init__(self, products: list[int], compiled: bool = False, norms: list[nn.Module] | None = None,
                 head: nn.Linear | None = None):
        self.products, self.compiled = products, compiled
        # where the rows library computes a forward whole (`_whole_step`): every norm's weight and epsilon
        self.norms = None if norms is None else ([norm.weight for norm in norms],
                                                 [norm.variance_epsilon for norm in norms])
        self.head = head  # the LM head the library multiplies by at the end of a whole forward (`room_for`)
        self.weights_held = False  # the rows library holds the weights for this call (`hold_weights`)
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer index -> keys', values' buffers
        self.rotary_tables: dict = {}  # the target's rotary cos and sin by position (`rotary_rows`)
        # layer index -> the keys and values the room gave the layer (`commit`): views of its buffers' front
        self.given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.key, self.buffers_held = next(_ROOM_KEYS), False  # the rows library holds the buffers (`hold_buffers`)

    def reserve(self, cache: Cache, n: int, views: bool = True
                ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, int]:
        """Room for `n` entries behind the `length` cached in every layer's buffers (the cache at their front), and
        `length`; with `views`, every layer's keys and values `[B, H, length + n, D]` there, for a forward that writes
        its block behind the cache and attends over them (one in the rows library's room takes none). `commit` makes
        the block part of the cache. A layer still holding the very tensors the room gave it is the front of its
        buffers without checking (transformers replaces a layer's tensors, never reshapes them in place): 0.2 ms a
        SmolLM2 step less."""
        for index, layer in enumerate(cache.layers):
            length, buffers = layer.keys.shape[2], self.buffers.get(index)
            if buffers is None or length + n >= buffers[0].shape[2] or not (  # never full: one compiled graph
                    self._holds_given(index, layer) or
                    _front_of(layer.keys, buffers[0]) and _front_of(layer.values, buffers[1])):
                room = max(self.MIN_ROOM, length // 16) + n
                buffers = self.buffers[index] = (_with_room(layer.keys, room), _with_room(layer.values, room))
                self.given.pop(index, None)  # what it gave the layer is of the buffers before
                self.buffers_held = False
        if not views:
            return None, None, length
        fronts = _fronts([buffer for index in range(len(cache.layers)) for buffer in self.buffers[index]], length + n)
        return fronts[0::2], fronts[1::2], length

    def commit(self, cache: Cache, length: int) -> None:
        """Each layer's cache is now the first `length` entries of its buffers, the block written behind the cache: the
        tensors the room gave the layer, grown in place by the rows library where it is loaded (no 60 new views a
        SmolLM2 step, each a Python object: ~0.1 ms), else new views."""
        grows, grown = rows.rows_kernel(), []
        for index, layer in enumerate(cache.layers):
            if grows and self._holds_given(index, layer):
                grown += self.given[index]
            else:
                keys, values = self.buffers[index]
                self.given[index] = layer.keys, layer.values = keys.narrow(2, 0, length), values.narrow(2, 0, length)
        if grown:
            torch.ops.hf_eagle31_rows.set_length(grown, length)

    def truncate(self, cache: Cache, length: int) -> None:
        """`truncate_cache(cache, length)`, the layers holding the tensors the room gave them cut in place by the rows
        library. Why: transformers' `crop` gives each layer new views, which the next `commit` replaces by views of its
        own: 120 Python objects made a SmolLM2 step that rejects part of its block, and 60 checks in `reserve` (0.4 ms
        of such an EAGLE step on an Intel Xeon, ~1.5%)."""
        layers = enumerate(cache.layers)
        if not (rows.rows_kernel() and all(self._holds_given(index, layer) for index, layer in layers)):
            truncate_cache(cache, length)
        elif length < cache.get_seq_length():
            torch.ops.hf_eagle31_rows.set_length([tensor for index in range(len(cache.layers))
                                                  for tensor in self.given[index]], length)

    def _holds_given(self, index: int, layer) -> bool:
        """Whether cache layer `index` still holds the very tensors the room gave it (`commit`): transformers replaces a
        layer's tensors, never reshapes them in place, so these are still the front of the layer's buffers."""
        given = self.given.get(index)
        return given is not None and layer.keys is given[0] and layer.values is given[1]

    def hold_weights(self, model: nn.Module) -> None:
        """Hand the rows library each product's weights and bias under its key, once a call, for a compiled graph that
        multiplies on the kernel (`_product`'s `direct`): a weight replaced between calls is the one the next uses.

        Why: the graph then names each product by its key, a constant, instead of taking its weights as inputs, and
        inductor's entry into a graph gathers and checks every input at every call: 0.5 ms of a compiled SmolLM2 step
        less (its ~210 weights of ~340 inputs; docs/benchmarks.md). The library holds the weights weakly, a model
        deleted is freed, but for a whole forward (`_whole_step`) strongly while the room lasts."""
        if not self.weights_held:
            members = _product_members(model) + ([(self.head,)] if self.head is not None else [])
            biases = [stacked_bias(tuple(linear.bias for linear in linears)) for linears in members]
            torch.ops.hf_eagle31_rows.hold([product_key(linears[0]) for linears in members],
                                           [len(linears) for linears in members],
                                           [linear.weight for linears in members for linear in linears], biases)
            self.weights_held = True
            # a whole forward's, looked up at the room's first and held for the rest (rows_step.cpp's `prepared_for`),
            # are let go when the room ends
            weakref.finalize(self, torch.ops.hf_eagle31_rows.release, self.key).atexit = False

    def hold_buffers(self) -> None:
        """Hand the rows library every layer's buffers under this room's key, where it does not hold them yet: a
        one-token step then writes and attends there (`_attention`); compiled, its graph takes none of the cache's
        views as inputs (60 for SmolLM2, each with a length of its own for inductor's entry to check and convert)."""
        if not self.buffers_held:
            layers = [self.buffers[index] for index in range(len(self.buffers))]
            torch.ops.hf_eagle31_rows.hold_room(self.key, [keys for keys, _ in layers],
                                                [values for _, values in layers])
            self.buffers_held = True


_ROOM_KEYS = itertools.count()


def _fronts(buffers: list[torch.Tensor], length: int) -> list[torch.Tensor]:
    """Each buffer's first `length` entries `[B, H, length, D]`: in one call of the rows library where it is loaded
    (60 `narrow`s from Python cost ~0.1 ms of a SmolLM2 step)."""
    if rows.rows_kernel():
        return torch.ops.hf_eagle31_rows.fronts(buffers, length)
    return [buffer.narrow(2, 0, length) for buffer in buffers]


def _front_of(entries: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `entries` is `buffer[:, :, :length]` (the same memory, laid out the same)."""
    return entries.data_ptr() == buffer.data_ptr() and entries.stride() == buffer.stride() and \
        entries.shape[:2] == buffer.shape[:2] and entries.shape[3] == buffer.shape[3]


def _with_room(entries: torch.Tensor, room: int) -> torch.Tensor:
    """A buffer holding `entries` `[B, H, L, D]` at its front, with `room` more positions behind them."""
    batch, heads, length, size = entries.shape
    buffer = entries.new_empty(batch, heads, length + room, size)
    buffer[:, :, :length] = entries
    return buffer


def room_for(target: PreTrainedModel, products: Products, compiled: bool = False) -> CacheRoom | None:
    """A fresh room where the target's verify forwards can take the lean forward on `products` (`fits`), None where
    they cannot.

    Where the library computes the forwards whole, it also multiplies by the LM head when the head's own call would
    only multiply (a quiet layer with a product: `Products.of`): the head's module call, under `ProductsMode`, cost
    ~0.25 ms beside its product, timed alone with the caches cold as after a step (docs/benchmarks.md)."""
    if not fits(target, products):
        return None
    norms = _norms(target.model)
    head = target.lm_head if norms is not None and products.of(target.lm_head) is not None else None
    return CacheRoom(product_keys(target.model), compiled, norms, head)


def _norms(model: nn.Module) -> list[nn.Module] | None:
    """Every layer's two norms, then the final one, where the rows library can compute the model's forwards whole
    (rows_step.cpp): its MLPs gate by SiLU (transformers' "silu"); None elsewhere."""
    layers = model.layers[: model.config.num_hidden_layers]
    if not all(type(layer.mlp.act_fn) in SILU for layer in layers):
        return None
    return [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.norm]


SILU = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))


def _product(key: int, x: torch.Tensor, out_features: int, direct: bool, ways: int) -> torch.Tensor:
    """The product under `key`. `direct`, in a compiled graph whose rows the rows kernel serves (a one-token step's
    count, `routes.on_kernel`; a block's, any count, `routes.serves_every_count`): the kernel itself on the weights
    and bias the rows library holds under the key (`CacheRoom.hold_weights`), the same call `Product.whole` makes
    (`ways`: how it reads the weights at each row count, `routes.ways`); the graph calls it through the dispatcher,
    where `packed_product` calls back into Python at every product (a noticeable share of a step:
    docs/benchmarks.md)."""
    if not direct:
        return packed_product(key, x, out_features)
    return torch.ops.hf_eagle31_rows.product(x, key, out_features, ways)


def _attention(attention: nn.Module, x: torch.Tensor, cos, sin, cache: tuple, length: int, mask: torch.Tensor,
               rotate_half: Callable, qkv: int, o: int, direct: bool, ways: int) -> torch.Tensor:
    # the packed product's heads `[B, n, queries + keys + values, D]`; the queries and keys turned at once, by
    # transformers' `apply_rotary_pos_emb` formula (the same products, half the operations);
    # the new keys and values written behind the cache: `cache`, the layer's keys and values in its room's buffers
    # (`CacheRoom.reserve`), or, in a one-token step, the room's key and the layer's index (`CacheRoom.hold_buffers`:
    # the rows library writes them there and attends)
    config, size = attention.config, attention.head_dim
    queries, kv = config.num_attention_heads, config.num_key_value_heads
    heads = _product(qkv, x, (queries + 2 * kv) * size, direct, ways).view(*x.shape[:-1], -1, size)
    turned = heads[:, :, : queries + kv]
    turned = turned * cos + rotate_half(turned) * sin
    new_keys, new_values = turned[:, :, queries:].transpose(1, 2), heads[:, :, queries + kv :].transpose(1, 2)
    query = turned[:, :, :queries].transpose(1, 2)
    if isinstance(cache[0], int):
        # its library's attention of a few rows (rows_attention.cpp: SDPA's CPU kernel spends most of a one-row call
        # setting up blocks of many; a block's rows it computes no faster)
        room, index = cache
        out = grouped_attention(query, new_keys, new_values, mask, attention.scaling,
                                lambda q, k, v, m, scale: torch.ops.hf_eagle31_rows.attention_in_room(
                                    q, k, v, room, index, length, m, scale))
    else:  # EAGLE's verify attention (`verification.tree_attention_forward`'s "batched" path, without a window)
        keys, values = cache
        keys[:, :, length:] = new_keys
        values[:, :, length:] = new_values
        out = grouped_attention(query, keys, values, mask, attention.scaling)
    return _product(o, out.transpose(1, 2).reshape(*x.shape[:-1], -1), config.hidden_size, direct, ways)


def _mlp(mlp: nn.Module, x: torch.Tensor, gate_up: int, down: int, direct: bool, ways: int) -> torch.Tensor:
    width = mlp.intermediate_size
    gate, up = _product(gate_up, x, 2 * width, direct, ways).split(width, dim=-1)
    return _product(down, mlp.act_fn(gate) * up, mlp.hidden_size, direct, ways)


def _decoder(model: nn.Module, products: list[int] | None, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None, length: int, mask: torch.Tensor,
             target_layer_ids: tuple[int, ...], direct: bool = False, ways: int = 0, room: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers and final norm over the block `x`: its last hidden states and the drafter's features.
    `products`: the model's `product_keys`, or None where traced (computed here, the keys are the graph's constants);
    `direct`: traced, the rows kernel multiplies every product (`_product`, with `ways`); `room`, in a one-token step,
    instead of `keys` and `values`: the key under which the rows library holds the cache's buffers, where it writes
    and attends (`_attention`)."""
    family, products = FAMILIES[type(model)], products or product_keys(model)
    states = {}
    for index, layer in enumerate(model.layers[: model.config.num_hidden_layers]):
        qkv, o, gate_up, down = products[4 * index : 4 * index + 4]
        states[index] = x
        cache = (keys[index], values[index]) if room is None else (room, index)
        x = x + _attention(layer.self_attn, family.norm.forward(layer.input_layernorm, x), cos, sin, cache, length,
                           mask, family.rotate_half, qkv, o, direct, ways)
        x = x + _mlp(layer.mlp, family.norm.forward(layer.post_attention_layernorm, x), gate_up, down, direct, ways)
    x = family.norm.forward(model.norm, x)
    states[model.config.num_hidden_layers] = x
    return x, torch.cat([states[i] for i in target_layer_ids], dim=-1) if target_layer_ids else None


@functools.cache
def compiled_decoder() -> Callable:
    """`_decoder` compiled by inductor, for `compile_verify` and `compile_step` (created once a process; dynamo
    compiles a graph per target, dtype and batch size, for any block size, cache length and packing of the weights:
    `product_keys`, and one of one-token steps).

    Why: on a CPU the eager forward spends much of its time between the products, in dozens of small operations a
    layer, each costlier than in a loop because the products streaming the weights evict the code and data they
    run on; inductor fuses them into a few C++ kernels, and its C++ wrapper (`cpp_wrapper`) calls those, and the
    products through the dispatcher (the rows kernel, or `packed_product`: `_product`), with no module dispatch in
    between. `emulate_precision_casts` rounds as eager does after each bf16 operation (bf16 logits eager's, or one
    bf16 rounding apart where a fused sum runs in another order); fp32 sums in another order too (logits a rounding
    error apart from eager's).
    """
    return torch.compile(_decoder, dynamic=True, fullgraph=True, options={
        "cpp_wrapper": True, "emulate_precision_casts": True, "guard_filter_fn": _ids_and_arguments})


def _ids_and_arguments(guards: list) -> list[bool]:
    """Which of dynamo's guards on `_decoder` a call checks: the ids of modules (the product keys name the model's
    own layers, so another model of the class compiles its own graph) and every guard on the other arguments and
    globals (dtype, batch size, layer ids, the family's functions), not the ~2,000 on the model's module tree (types,
    attributes, parameters).

    Why: checking those costs a noticeable share of a verify forward at every call, and they guard nothing a model
    changes under a generate call: the graph reads its structure (layer count, head counts, sizes, fixed for a
    model) and its norms' weights, which it takes as inputs at each call.
    """
    return [guard.guard_type == "ID_MATCH" or not guard.orig_guard.source.is_unspecialized_nn_module()
            for guard in guards]


def _whole_step(model: nn.Module, room: CacheRoom, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int,
                mask: torch.Tensor, target_layer_ids: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_decoder`'s result, computed whole by the rows library (rows_step.cpp) on the weights and the cache room it
    holds: one call a forward instead of about 30 small operations a layer between the products; and the room's
    `head`'s float logits `[B, n, V]` (None without one)."""
    config, attention = model.config, model.layers[0].self_attn
    room.hold_weights(model)
    weights, eps = room.norms
    x, features, logits = torch.ops.hf_eagle31_rows.step(
        x, room.products, weights, eps, cos, sin, room.key, length, mask, attention.scaling,
        config.num_attention_heads, config.num_key_value_heads, model.layers[0].mlp.intermediate_size,
        target_layer_ids, routes.ways(x.dtype), -1 if room.head is None else product_key(room.head))
    return x, features if target_layer_ids else None, logits if room.head is not None else None


def llama_verify_forward(target: PreTrainedModel, cache: Cache, room: CacheRoom, plan, tokens: torch.Tensor,
                         positions: torch.Tensor, target_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_forward`'s result where `fits` and `fits_step`: raw float logits `[B, n, V]`, features `[B, n, 3 H_t]`."""
    model, n = target.model, tokens.shape[1]
    x = model.embed_tokens(tokens)
    config = model.config
    # one graph for every block size, none that equal another size by chance; one-token forwards compile a graph
    # of their own, so only a plain call's steps (`fast_decoding`: no features) take one, not an EAGLE call's rare
    # plain step (a fallback where drafting does not pay), which would stop to compile mid-call
    compiled = room.compiled and (n > 1 or not target_layer_ids)
    # the products on the rows kernel: eager, or compiled for one token; a compiled block's where it serves every count
    direct = routes.serves_every_count(x.dtype) if compiled and n > 1 else routes.on_kernel(tokens.numel(), x.dtype)
    attends = x.dtype in (torch.float32, torch.bfloat16) and rows.attends(model.layers[0].self_attn.head_dim)
    # eager on the kernel, the layers computed whole by the library (`_whole_step`)
    whole = direct and attends and not compiled and room.norms is not None
    # the cache in the library, which writes and attends there: a whole forward's, and a one-token step's
    in_room = attends and (whole or n == 1 and (direct or not compiled))
    keys, values, length = room.reserve(cache, n, views=not in_room)
    # over the heads; a table's rows, the block's positions being below the entries cached and written
    cos, sin = (part.unsqueeze(2) for part in rotary_rows(model.rotary_emb, x, positions, room.rotary_tables,
                                                          length + n))
    if in_room:
        room.hold_buffers()
    # a one-token step of rows without pads or holes sees every cached key: the library's attention adds no mask
    # (adding the zeros changes no score)
    mask = None if in_room and n == 1 and plan.key_padding is None else plan.additive_layer_mask(
        length + n, None, x.dtype, config.num_attention_heads // config.num_key_value_heads)
    inputs = (x, cos, sin, keys, values, length, mask, tuple(target_layer_ids))
    logits = None  # the head's, where the library multiplied by it
    if whole:
        x, features, logits = _whole_step(model, room, x, cos, sin, length, mask, list(target_layer_ids))
    elif compiled:
        if direct:
            room.hold_weights(model)
        try:  # the norms' eps and the attention's scale as constants: as inputs dynamo restarted tracing (slow)
            with fx_config.patch(use_duck_shape=False), dynamo_config.patch(specialize_float=True):
                x, features = compiled_decoder()(model, None, *inputs, direct, routes.ways(x.dtype),
                                                 room.key if in_room else None)
        except torch._dynamo.exc.BackendCompilerFailed as error:  # no C++ compiler, or one inductor cannot use
            raise RuntimeError("inductor could not compile the target's forward (compile_verify=True, or "
                               f"fast_decoding's compile_step=True: {type(error).__name__}); install a C++ compiler "
                               "(g++), or run it eagerly: drafter.generation_config.compile_verify = False, "
                               "compile_step=False") from error
    else:
        x, features = _decoder(model, room.products, *inputs, room=room.key if in_room else None)
    room.commit(cache, length + n)
    if logits is not None:
        return logits, features
    with products_mode(active_products()):  # the head as a module (its hooks see every forward), on its product
        return target.lm_head(x).float(), features
