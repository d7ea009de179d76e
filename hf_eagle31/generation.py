"""EAGLE decoding behind `target.generate(..., assistant_model=drafter)`: settings, checks and routing.

The decoding itself is one loop (decoding.py) for every batch size, chain or tree, verify mode
and cache. transformers has no registry for third-party assisted decoding, so importing
hf_eagle31 wraps four `GenerationMixin` methods (`install`). Each wrapper acts only when
`assistant_model` is an `Eagle3DraftModel` and otherwise calls the original with the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.generation import GenerationMixin

from hf_eagle31 import llama_verify
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.configuration import SPECULATION_DEFAULTS, default_target_layer_ids
from hf_eagle31.control import CollapseMonitor, LengthController
from hf_eagle31.decoding import Speculation, eagle_decoding
from hf_eagle31.kernels.tree_attention import require_triton
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packing import fast_bf16, packed_weights
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.verification import (
    VERIFY_MODES,
    UnsupportedTargetError,
    exact_mode_hooks,
    has_sliding_window,
    leave_exact_mode,
    verifying_attention,
)


POSITIVE_SETTINGS = {"num_assistant_tokens": 64, "tree_depth": 64, "tree_top_k": 64, "tree_total_tokens": 1024,
                     "max_speculation_depth": 64, "verify_chunk_depth": 64}  # name -> largest value accepted
CHOICES = {"speculation_mode": ("chain", "tree"), "verify_mode": VERIFY_MODES}
SWITCHES = ("dynamic_speculation", "collapse_fallback", "pack_weights", "compile_verify")


def speculation_setting(drafter: Eagle3DraftModel, name: str) -> Any:
    """A speculation setting from the drafter's generation config (the default when unset), checked when read:
    a misspelt mode or an impossible size is named here, not met as a wrong mode or a torch error later."""
    config = drafter.generation_config
    value = getattr(config, name, None)
    if value is None and not (name in CHOICES and name in vars(config)):  # unset (a mode set to None is an error)
        return SPECULATION_DEFAULTS[name]
    if name in CHOICES and value not in CHOICES[name]:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, CHOICES[name]))}, got {value!r}")
    if name in POSITIVE_SETTINGS and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= POSITIVE_SETTINGS[name]):
        raise ValueError(f"{name} must be an integer from 1 to {POSITIVE_SETTINGS[name]}, got {value!r}")
    if name in SWITCHES and not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def verify_mode(drafter: Eagle3DraftModel) -> str:
    """How verify forwards are computed: "batched", "kernel" or "exact" (see `VerifyPlan`); "kernel" asks for the
    Triton kernel, whose missing extra is named before any work."""
    mode = speculation_setting(drafter, "verify_mode")
    if mode == "kernel":
        require_triton()
    return mode


def packs_weights(drafter: Eagle3DraftModel) -> bool:
    """Whether this drafter's calls verify on packed weights where the target can have them (packing.py)."""
    return speculation_setting(drafter, "pack_weights") and verify_mode(drafter) != "exact"


def compiles_verify(drafter: Eagle3DraftModel, pack: bool | None = None) -> bool:
    """Whether this drafter's calls verify with the compiled lean forward where the target takes the lean one: only
    on packed weights, the drafter's own `pack_weights` path unless `pack` names one (tuning times both)."""
    return speculation_setting(drafter, "compile_verify") and (packs_weights(drafter) if pack is None else pack)


def prepare_drafter(target: PreTrainedModel, drafter: Eagle3DraftModel) -> None:
    """Check the pair fits together (clear errors, not a shape error deep in torch) and share the embedding."""
    tc, dc = target.config.get_text_config(), drafter.config
    name = type(target).__name__
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(
            f"The drafter was built for a vocabulary of {dc.vocab_size} tokens, but the target {name} has "
            f"{tc.vocab_size}: this drafter belongs to a different target model."
        )
    if dc.target_hidden_size != tc.hidden_size:
        raise ValueError(
            f"The drafter reads target features of width {dc.target_hidden_size}, but the target {name} has "
            f"hidden size {tc.hidden_size}: this drafter belongs to a different target model."
        )
    layers = tc.num_hidden_layers
    if dc.target_layer_ids is None:
        dc.target_layer_ids = default_target_layer_ids(layers)
    if max(dc.target_layer_ids) > layers or min(dc.target_layer_ids) < 0:
        raise ValueError(
            f"target_layer_ids {dc.target_layer_ids} are out of range for the target {name} with {layers} layers."
        )
    embedding = target.get_input_embeddings()
    if drafter.fc.weight.device != embedding.weight.device:
        raise ValueError(f"the drafter is on {drafter.fc.weight.device} but the target's embedding is on "
                         f"{embedding.weight.device}: move it with drafter.to({str(embedding.weight.device)!r})")
    if drafter.get_input_embeddings() is not embedding:
        drafter.set_target_embedding(embedding)


def drafting_dtype(target: PreTrainedModel) -> torch.dtype:
    """The dtype a drafter runs fastest in beside `target`: bf16 where the target's device computes it at full
    speed, else the target's own. Why: a draft level streams the drafter's weights for a few tokens, so half the
    bytes is most of half the time (a level 2.2-2.6 ms instead of 3.0 ms beside fp32 SmolLM2 on the 2-core CPU,
    the tokens accepted unchanged), and the target verifies every draft, so the output does not depend on it."""
    return torch.bfloat16 if fast_bf16(target.device) else target.dtype


def _length_controller(drafter: Eagle3DraftModel, start: int) -> LengthController:
    if not speculation_setting(drafter, "dynamic_speculation"):
        return LengthController(low=start, high=start, value=start)
    return LengthController(low=1, high=max(start, speculation_setting(drafter, "max_speculation_depth")), value=start)


@dataclass
class _Verifying:
    """What EAGLE switched on in one target for its calls in flight (see `eagle_verification`)."""

    previous: str  # the attention implementation to restore
    hooks: list
    calls: int = 0


_VERIFYING: dict[int, _Verifying] = {}  # id(target) -> its switches, while at least one call runs
_VERIFYING_LOCK = threading.Lock()


@contextlib.contextmanager
def eagle_verification(target: PreTrainedModel):
    """While EAGLE decodes: the `eagle_tree` attention function and the "exact" mode hooks (see verification.py).

    They belong to the target, so calls running at once in several threads share them: the first
    call switches them on and the last switches them off (a call restoring the previous attention
    while another still verifies would give that one wrong output, or leave `eagle_tree` behind).
    Everything else a call needs lives in the call. `eagle_tree` is the target's own attention for
    any forward without a verify plan, so plain calls running meanwhile compute as without EAGLE.
    """
    with _VERIFYING_LOCK:
        verifying = _VERIFYING.get(id(target))
        if verifying is None:
            previous = target.config._attn_implementation
            if target._can_set_attn_implementation():  # see `check_target` for the models that cannot
                target.set_attn_implementation(verifying_attention(previous))
            verifying = _VERIFYING[id(target)] = _Verifying(previous, exact_mode_hooks(target))
        verifying.calls += 1
    try:
        yield
    finally:
        leave_exact_mode()  # torch runs the leaving hook on Exception only: Ctrl-C must not leave it on
        with _VERIFYING_LOCK:
            verifying.calls -= 1
            if not verifying.calls:
                del _VERIFYING[id(target)]
                for hook in verifying.hooks:
                    hook.remove()
                target.set_attn_implementation(verifying.previous)


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_target(target: PreTrainedModel) -> None:
    """Refuse, by name and before any work, a target whose layers EAGLE cannot verify and roll back exactly.

    Verification computes attention over a tree with transformers' AttentionInterface and rolls a
    rejected draft back by dropping KV entries: a layer that keeps a recurrent state (Mamba, linear
    attention) cannot drop a rejected branch, and other attention kinds (chunked, indexed) are not masked that way.
    A model that bypasses the interface is verified only on SDPA without windows, where its own
    attention takes the tree mask as given (the "exact" and "kernel" modes then compute as "batched").
    """
    name, text = type(target).__name__, target.config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or ()
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES)) or (["recurrent"] if target._is_stateful else [])
    if unsupported:
        raise UnsupportedTargetError(
            f"EAGLE cannot verify {name}: it has {', '.join(unsupported)} layers, and EAGLE verifies a draft tree and "
            f"rolls it back only in {' and '.join(SUPPORTED_LAYER_TYPES)} layers; generate without the drafter")
    if not target._can_set_attn_implementation() and (target.config._attn_implementation != "sdpa"
                                                       or has_sliding_window(text)):
        raise UnsupportedTargetError(
            f"EAGLE cannot verify {name}: its attention does not go through transformers' AttentionInterface, and "
            f"without it only SDPA attention with no sliding window takes a tree mask (it runs "
            f"{target.config._attn_implementation!r}); generate without the drafter")


def rope_parameters(text_config) -> list[dict]:
    """The target's rotary settings: one `rope_parameters`, or one per layer type."""
    parameters = getattr(text_config, "rope_parameters", None) or {}
    return [parameters] if "rope_type" in parameters else [v for v in parameters.values() if isinstance(v, dict)]


def check_positions(target: PreTrainedModel, prompt_length: int, max_length: int) -> None:
    """Refuse rotary tables that change with the sequence length while this call crosses the length they change at.

    Plain decoding meets such a change one position at a time (Phi-3's longrope even recomputes its
    cache when it crosses `original_max_position_embeddings`); a verify forward meets it at a
    draft's deepest position, earlier, and its cached keys keep the old table: another output.
    """
    text = target.config.get_text_config()
    for parameters in rope_parameters(text):
        original = parameters.get("original_max_position_embeddings")
        if parameters.get("rope_type") == "longrope" and prompt_length <= original < max_length:
            raise ValueError(
                f"EAGLE decoding cannot cross {type(target).__name__}'s longrope switch at original_max_position_"
                f"embeddings={original} (the prompt has {prompt_length} tokens, max_length is {max_length}): plain "
                "decoding recomputes its cache there; generate without the drafter, or stop at that length")
        if parameters.get("rope_type") == "dynamic" and max_length > text.max_position_embeddings:
            raise ValueError(
                f"EAGLE decoding cannot run past max_position_embeddings={text.max_position_embeddings} with dynamic "
                f"rope scaling (max_length is {max_length}): the rotary table then changes with the longest position "
                "computed, which a draft reaches earlier than plain decoding; generate without the drafter")


def check_inputs(target: PreTrainedModel, input_ids: torch.Tensor, generation_config, model_kwargs) -> None:
    """Refuse, by name and before any work, what EAGLE decoding cannot do exactly."""
    check_positions(target, input_ids.shape[1], generation_config.max_length)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError("EAGLE decoding needs left-padded prompts (tokenizer.padding_side = 'left'); these are "
                         "right-padded, which plain generate too decodes wrongly (it continues from the pads)")
    if generation_config.guidance_scale not in (None, 1) and input_ids.shape[0] > 1:
        raise ValueError("EAGLE decoding supports classifier-free guidance (guidance_scale) only with one prompt: "
                         "its processor runs the target on one sequence, one token at a time")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("EAGLE decoding cannot return attentions or hidden states (output_attentions / "
                         "output_hidden_states); generate without the drafter for those")
    if generation_config.use_cache is False:
        raise ValueError("EAGLE decoding needs the KV cache: use_cache=False is not supported")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("EAGLE decoding needs token ids (the drafter embeds them): pass input_ids, not inputs_embeds")
    cache = model_kwargs.get(CACHE_KWARG)
    static = generation_config.cache_implementation == "static" or isinstance(cache, StaticCache)
    if generation_config.cache_implementation not in (None, "dynamic", "static") or (
            cache is not None and not isinstance(cache, DynamicCache | StaticCache)):
        raise ValueError("EAGLE decoding rolls rejected drafts back in a DynamicCache or a StaticCache; got "
                         f"cache_implementation={generation_config.cache_implementation!r} / {type(cache).__name__}")
    if static and (input_ids.shape[0] > 1 or has_sliding_window(target.config.get_text_config())):
        raise ValueError("EAGLE decoding on a static cache takes one prompt and a target without sliding windows; "
                         "use the default dynamic cache for batches and sliding-window targets")


def batch_shape(drafter: Eagle3DraftModel, batch_size: int) -> dict | None:
    """The tuned shape for the largest tuned batch size up to `batch_size` (`tuning.batch_shapes`), if any."""
    shapes = getattr(drafter.generation_config, "batch_shapes", None) or {}
    fitting = [int(size) for size in shapes if int(size) <= batch_size]
    return shapes[str(max(fitting))] if fitting else None


def tuned_shape(drafter: Eagle3DraftModel, batch_size: int, do_sample: bool) -> dict | None:
    """The shape tuning chose for this kind of call, if any: for its batch size (`batch_shapes`), or for sampling
    one row (`sampling_shape`, `tuning.sampling_tuning`); None: the drafter's own chain or tree settings."""
    if batch_size > 1:
        shape, name = batch_shape(drafter, batch_size), "batch_shapes"
    else:
        shape, name = (getattr(drafter.generation_config, "sampling_shape", None) if do_sample else None,
                       "sampling_shape")
    if shape is None:
        return None
    sizes = ("tree_top_k", "tree_depth", "tree_total_tokens")
    if not (isinstance(shape, dict) and all(isinstance(shape.get(size), int) and shape[size] >= 1 for size in sizes)
            and isinstance(shape.get("speedup"), (int, float))):
        raise ValueError(f"{name} holds {shape!r}; a tuned shape is a dict of positive integers tree_top_k, "
                         "tree_depth and tree_total_tokens and a predicted speedup (see hf_eagle31.tuning), "
                         f"or set {name} to None")
    return shape


def speculation_for(drafter: Eagle3DraftModel, batch_size: int, do_sample: bool = False) -> Speculation | None:
    """How a call with `batch_size` prompts drafts: the drafter's speculation settings, or the shape tuned for
    this kind of call (`tuned_shape`); None where tuning predicted that no shape pays for it (plain decoding then)."""
    mode = speculation_setting(drafter, "speculation_mode")
    top_k, depth, total = (speculation_setting(drafter, name) for name in ("tree_top_k", "tree_depth",
                                                                             "tree_total_tokens"))
    if mode == "chain":
        top_k, depth = 1, speculation_setting(drafter, "num_assistant_tokens")
    shape = tuned_shape(drafter, batch_size, do_sample)
    if shape is not None:
        if shape["speedup"] < 1.0:
            return None
        mode = "chain" if shape["tree_top_k"] == 1 else "tree"
        top_k, depth, total = shape["tree_top_k"], shape["tree_depth"], shape["tree_total_tokens"]
    controller = _length_controller(drafter, depth)
    monitor = CollapseMonitor(enabled=bool(speculation_setting(drafter, "collapse_fallback")))
    if batch_size > 1:
        monitor.plain_left = 1  # time a plain step of this batch first: it is what speculation must beat
    return Speculation(mode, top_k, controller.high if top_k == 1 else total, controller, monitor,
                       speculation_setting(drafter, "verify_chunk_depth"), verify_mode(drafter))


# --- routing `generate(assistant_model=<Eagle3DraftModel>)` --------------------------------------


# speculation settings a GenerationConfig does not have: in a call's generation config they were put there by hand
NOT_GENERATE_SETTINGS = tuple(name for name in SPECULATION_DEFAULTS if name not in vars(GenerationConfig()))


def refuse_call_settings(kwargs: dict) -> None:
    """A speculation setting given to `generate` (a keyword, or an entry of its generation config) would be an unused
    model keyword to transformers, or silently ignored: name where it belongs instead (the drafter's generation
    config, which every call with that drafter reads)."""
    given = [name for name in SPECULATION_DEFAULTS if name in kwargs]
    if given:
        name = given[0]
        raise ValueError(
            f"{', '.join(given)}: speculation settings belong to the drafter, not to one generate() call; set "
            f"drafter.generation_config.{name} = {kwargs[name]!r} (it stays for later calls), or load the drafter "
            f"with Eagle3DraftModel.from_pretrained(path, {name}={kwargs[name]!r})")


CONTINUOUS_BATCHING_REFUSAL = (
    "EAGLE drafters are not supported by continuous batching (generate_batch) yet: its paged cache gives each request "
    "one new token per step, and it would ignore the drafter and decode without it. Use "
    "target.generate(input_ids, attention_mask=..., assistant_model=drafter), which also takes a padded batch")


def install() -> None:
    """Wrap the GenerationMixin methods that decide how assisted generation runs, and refuse a drafter in
    `generate_batch`, which would silently decode without it (idempotent)."""
    if getattr(GenerationMixin._assisted_decoding, "_hf_eagle31", False):
        return
    validate = GenerationMixin._validate_generation_mode
    assisted = GenerationMixin._assisted_decoding
    continuous = GenerationMixin.generate_batch
    extract = GenerationMixin._extract_generation_mode_kwargs

    @functools.wraps(validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = generation_mode_kwargs.get("assistant_model")
        if isinstance(drafter, Eagle3DraftModel):
            refuse_call_settings({name: getattr(generation_config, name) for name in NOT_GENERATE_SETTINGS
                                  if name in vars(generation_config)})
            check_target(self)
            prepare_drafter(self, drafter)  # before transformers mistakes a mismatch for a tokenizer issue
        return validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(assisted)
    def _assisted_decoding(self, input_ids, *args, **kwargs):
        drafter = kwargs.get("assistant_model")
        if not isinstance(drafter, Eagle3DraftModel):
            return assisted(self, input_ids, *args, **kwargs)
        check_inputs(self, input_ids, kwargs["generation_config"], kwargs)
        for unused in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer", "synced_gpus"):
            kwargs.pop(unused, None)
        prepare_drafter(self, drafter)
        speculation = speculation_for(drafter, input_ids.shape[0], bool(kwargs["generation_config"].do_sample))
        if speculation is None:
            drafter.speculation_stats = SpeculationStats(mode=speculation_setting(drafter, "speculation_mode"),
                                                         fallbacks=1)
            return self._sample(input_ids, *args, **kwargs)
        config = kwargs["generation_config"]
        if speculation.verify_mode == "batched" and self._valid_auto_compile_criteria(kwargs, config):
            speculation.compiled = self.get_compiled_call(config.compile_config)  # as plain decoding compiles
            speculation.block_size, speculation.chunk_depth = speculation.total_tokens + 1, None
        pack = packs_weights(drafter)  # a compiled forward calls the packed products as opaque ops (packing.py)
        with eagle_verification(self), packed_weights(self, pack), packed_weights(drafter, pack):
            # the lean forward multiplies by this call's packing (another thread's may go while this call runs)
            speculation.lean = llama_verify.room_for(self, compiles_verify(drafter)) if pack else None
            return eagle_decoding(self, input_ids, *args, drafter=drafter, speculation=speculation, **kwargs)

    @functools.wraps(extract)
    def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        if isinstance(assistant_model, Eagle3DraftModel):
            refuse_call_settings(kwargs)
        return extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)

    @functools.wraps(continuous)
    def generate_batch(self, *args, **kwargs):
        if isinstance(kwargs.get("assistant_model"), Eagle3DraftModel):
            raise NotImplementedError(CONTINUOUS_BATCHING_REFUSAL)
        return continuous(self, *args, **kwargs)

    for wrapper in (_validate_generation_mode, _assisted_decoding, generate_batch,
                    _extract_generation_mode_kwargs):
        wrapper._hf_eagle31 = True
        setattr(GenerationMixin, wrapper.__name__, wrapper)
