"""EAGLE decoding behind `target.generate(..., assistant_model=drafter)`: settings, checks and routing.

The decoding itself is one loop (decoding.py) for every batch size, chain or tree, verify mode
and cache. transformers has no registry for third-party assisted decoding, so importing
hf_eagle31 wraps four `GenerationMixin` methods (`install`). Each wrapper acts only when
`assistant_model` is an `Eagle3DraftModel` and otherwise calls the original with the same arguments.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.generation import GenerationMixin

from hf_eagle31.backends import Prepared, backend_for, fast_bf16, prepare
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.configuration import (
    RENAMED_SETTINGS,
    SPECULATION_DEFAULTS,
    SpeculationSettings,
    default_target_layer_ids,
)
from hf_eagle31.control import CollapseMonitor, DepthController
from hf_eagle31.decoding import Speculation, eagle_decoding
from hf_eagle31.features import capturing_hooked, remove_capturing_hooks
from hf_eagle31.interrupts import Held
from hf_eagle31.kernels.tree_attention import require_triton
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.exact import OwnForwardByPosition
from hf_eagle31.verification import UnsupportedTargetError, has_sliding_window, verifying_attention


def checked_verify_mode(settings: SpeculationSettings) -> str:
    """How verify forwards are computed: "batched", "kernel" or "exact" (see `VerifyPlan`); "kernel" asks for the
    Triton kernel, whose missing extra is named before any work."""
    if settings.verify_mode == "kernel":
        require_triton()
    return settings.verify_mode


def on_cpu_backend(settings: SpeculationSettings) -> bool:
    """Whether these settings' calls run on the CPU backend where it serves the target (hf_eagle31.backends): not
    under "exact" verification, which computes on the model's own weights."""
    return settings.cpu_backend and settings.verify_mode != "exact"


def compiles_verify(settings: SpeculationSettings, cpu_backend: bool) -> bool:
    """Whether a call on the CPU backend or not (`cpu_backend`: the settings' own, or one tuning times) verifies with
    the compiled lean forward where the target takes the lean one: only on the CPU backend."""
    return settings.compile_verify and cpu_backend


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
    # where accelerate offloads the embedding, its weight waits on "meta" and its hook computes on this device
    device = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None) or embedding.weight.device
    if drafter.fc.weight.device != torch.device(device):
        raise ValueError(f"the drafter is on {drafter.fc.weight.device} but the target's embedding computes on "
                         f"{device}: move the drafter there with drafter.to({str(device)!r})")
    if drafter.get_input_embeddings() is not embedding:
        drafter.set_target_embedding(embedding)


def drafting_dtype(target: PreTrainedModel) -> torch.dtype:
    """The dtype a drafter runs fastest in beside `target`: bf16 where the target's device computes it at full
    speed, else the target's own. Why: a draft level streams the drafter's weights for a few tokens, so half the
    bytes is most of half the time (docs/benchmarks.md), and the target verifies every draft, so the output does
    not depend on it."""
    return torch.bfloat16 if fast_bf16(target.device) else target.dtype


@dataclass
class _Verifying:
    """What EAGLE switched on in one target for its calls in flight (see `eagle_verification`)."""

    previous: str  # the attention implementation to restore
    hooked: set[int]  # the modules transformers had put its output-capturing hooks on before the first call
    patched: OwnForwardByPosition | None = None
    calls: int = 0


_VERIFYING: dict[int, _Verifying] = {}  # id(target) -> its switches, while at least one call runs
_VERIFYING_LOCK = threading.Lock()


def eagle_verification(target: PreTrainedModel) -> Held:
    """While EAGLE decodes: the `eagle_tree` attention function, and bitsandbytes layers run position by position
    in "exact" verify forwards (`OwnForwardByPosition`; see exact.py).

    They belong to the target, so calls running at once in several threads share them: the first
    call switches them on and the last switches them off (a call restoring the previous attention
    while another still verifies would give that one wrong output, or leave `eagle_tree` behind).
    The last also removes the output-capturing hooks transformers installed for the calls' prefills.
    Each switch is made and undone whole, a Ctrl-C then raised (`Held`). Everything else a call needs
    lives in the call. `eagle_tree` is the target's own attention for any forward without a verify plan,
    so plain calls running meanwhile compute as without EAGLE.
    """
    def switch_on():
        with _VERIFYING_LOCK:
            verifying = _VERIFYING.get(id(target))
            if verifying is None:
                verifying = _Verifying(target.config._attn_implementation, capturing_hooked(target))
                try:
                    if target._can_set_attn_implementation():  # see `check_target` for the models that cannot
                        target.set_attn_implementation(verifying_attention(verifying.previous))
                    verifying.patched = OwnForwardByPosition(target)
                except BaseException:
                    _switch_back(target, verifying)
                    raise
                _VERIFYING[id(target)] = verifying
            verifying.calls += 1

    def switch_off():
        with _VERIFYING_LOCK:
            verifying = _VERIFYING[id(target)]
            verifying.calls -= 1
            if not verifying.calls:
                del _VERIFYING[id(target)]
                _switch_back(target, verifying)

    return Held(switch_on, switch_off)


def _switch_back(target: PreTrainedModel, verifying: _Verifying) -> None:
    if verifying.patched is not None:
        verifying.patched.remove()
    if target.config._attn_implementation != verifying.previous:
        target.set_attn_implementation(verifying.previous)
    remove_capturing_hooks(target, verifying.hooked)


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_layers(text_config) -> list[str]:
    """The kinds of layers EAGLE cannot verify, as the config names them: `layer_types`, or where a release gives a
    hybrid config none, `layers_block_type` (RecurrentGemma's "recurrent" and "attention" blocks on 5.17)."""
    kinds = getattr(text_config, "layer_types", None) or getattr(text_config, "layers_block_type", None) or ()
    return sorted(set(kinds) - {*SUPPORTED_LAYER_TYPES, "attention"})


def check_target(target: PreTrainedModel) -> None:
    """Refuse, by name and before any work, a target whose layers EAGLE cannot verify and roll back exactly.

    Verification computes attention over a tree with transformers' AttentionInterface and rolls a
    rejected draft back by dropping KV entries: a layer that keeps a recurrent state (Mamba, linear
    attention) cannot drop a rejected branch, and other attention kinds (chunked, indexed) are not masked that way.
    Models whose state transformers' caches cannot hold (RWKV, xLSTM: `generate` gives them no `DynamicCache`) have
    no layer kinds to read, so they are known by that. A model that bypasses the interface is verified only on SDPA
    without windows, where its own attention takes the tree mask as given (the "exact" and "kernel" modes then
    compute as "batched").
    """
    name, text = type(target).__name__, target.config.get_text_config()
    unsupported = unsupported_layers(text)
    if unsupported:
        raise UnsupportedTargetError(
            f"EAGLE cannot verify {name}: it has {', '.join(unsupported)} layers, and EAGLE verifies a draft tree and "
            f"rolls it back only in {' and '.join(SUPPORTED_LAYER_TYPES)} layers; generate without the drafter")
    if not target._supports_default_dynamic_cache():
        raise UnsupportedTargetError(
            f"EAGLE cannot verify {name}: it keeps a state of its own that transformers' caches do not hold (a "
            f"recurrent state or memory), and EAGLE rolls a draft tree back only in a DynamicCache or StaticCache; "
            f"generate without the drafter")
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


def speculation_plan(target: PreTrainedModel, drafter: Eagle3DraftModel, settings: SpeculationSettings,
                     input_ids: torch.Tensor, generation_config: GenerationConfig,
                     model_kwargs: dict) -> Speculation | None:
    """How this call drafts and verifies, decided once before it starts: the drafter's chain or tree settings, or the
    shape tuned for this kind of call (`SpeculationSettings.tuned_shape`); None where tuning predicted that no shape
    pays for it (plain decoding then).

    With `dynamic_speculation` the depth drafts start at moves within 1..max_speculation_depth (never below the
    start's own bound), else it stays. Where transformers would compile plain decoding (a static cache and
    `compile_config`), "batched" verification runs the target's compiled call on blocks of one fixed size, whole
    trees (no `verify_chunk_depth`): one graph a call."""
    batch_size = input_ids.shape[0]
    shape = settings.tuned_shape(batch_size, bool(generation_config.do_sample))
    if shape is not None and shape.speedup < 1.0:
        return None
    if shape is not None:
        mode = "chain" if shape.tree_top_k == 1 else "tree"
        tree_top_k, tree_depth, tree_total_tokens = shape.tree_top_k, shape.tree_depth, shape.tree_total_tokens
    elif settings.speculation_mode == "chain":
        mode, tree_top_k, tree_depth, tree_total_tokens = "chain", 1, settings.num_assistant_tokens, None
    else:
        mode, tree_top_k, tree_depth = "tree", settings.tree_top_k, settings.tree_depth
        tree_total_tokens = settings.tree_total_tokens
    max_depth = max(tree_depth, settings.max_speculation_depth) if settings.dynamic_speculation else tree_depth
    controller = DepthController(min_depth=1 if settings.dynamic_speculation else tree_depth, max_depth=max_depth,
                                 depth=tree_depth)
    if tree_top_k == 1:
        tree_total_tokens = max_depth  # a chain keeps every node it drafts
    monitor = CollapseMonitor(enabled=settings.collapse_fallback)
    if batch_size > 1:
        monitor.plain_left = 1  # time a plain step of this batch first: it is what speculation must beat
    verify_mode = checked_verify_mode(settings)
    compiled = None
    if verify_mode == "batched" and target._valid_auto_compile_criteria(model_kwargs, generation_config):
        compiled = target.get_compiled_call(generation_config.compile_config)  # as plain decoding compiles
    cpu_backend = on_cpu_backend(settings)
    return Speculation(mode=mode, tree_top_k=tree_top_k, tree_total_tokens=tree_total_tokens, controller=controller,
                       monitor=monitor, verify_chunk_depth=None if compiled else settings.verify_chunk_depth,
                       verify_mode=verify_mode, cpu_backend=cpu_backend,
                       compile_verify=compiles_verify(settings, cpu_backend),
                       static_draft=drafts_static(settings, drafter.device), compiled=compiled,
                       block_size=tree_total_tokens + 1 if compiled else 0)


def prepared_for(target: PreTrainedModel, drafter: Eagle3DraftModel | None, speculation: Speculation) -> Prepared:
    """What the call runs on: the backend its plan names, prepared inside `eagle_verification(target)` (the CPU
    backend's lean forward reads the attention that switches on)."""
    return prepare(backend_for(target, speculation.cpu_backend), target, drafter, speculation.compile_verify)


def drafts_static(settings: SpeculationSettings, device: torch.device) -> bool:
    """`draft_mode`: "auto" drafts fixed shapes where the host would otherwise wait for the device between levels
    (CUDA, where they replay as graphs); a CPU waits for nothing and drafts fewer nodes narrowed."""
    return settings.draft_mode == "static" or (settings.draft_mode == "auto" and device.type == "cuda")


def warn_if_kernel_cannot_run(target: PreTrainedModel, settings: SpeculationSettings, input_ids: torch.Tensor,
                              model_kwargs: dict) -> None:
    """`verify_mode="kernel"` runs the Triton kernel only for one unpadded row on CUDA, on SDPA attention without
    sliding windows; elsewhere the call verifies as "batched", and says so (once a process for each reason)."""
    if settings.verify_mode != "kernel":
        return
    mask = model_kwargs.get("attention_mask")
    reasons = {"the target is not on CUDA": target.device.type != "cuda",
               "the batch has more than one prompt": input_ids.shape[0] > 1,
               "the prompt is padded": mask is not None and not bool(mask.all()),
               "the target has sliding-window layers": has_sliding_window(target.config.get_text_config()),
               "the target runs eager attention": target.config._attn_implementation == "eager"}
    for reason in (reason for reason, holds in reasons.items() if holds and reason not in _KERNEL_WARNED):
        _KERNEL_WARNED.add(reason)
        warnings.warn(f'verify_mode="kernel": {reason}, so this call verifies as "batched" (the Triton kernel '
                      "serves one unpadded prompt on CUDA, SDPA attention, no sliding window)", stacklevel=5)


_KERNEL_WARNED: set[str] = set()


# --- routing `generate(assistant_model=<Eagle3DraftModel>)` --------------------------------------


# speculation settings (and their old names) a GenerationConfig does not have: in a call's generation config they were
# put there by hand
NOT_GENERATE_SETTINGS = tuple(name for name in (*SPECULATION_DEFAULTS, *RENAMED_SETTINGS)
                              if name not in vars(GenerationConfig()))


def refuse_call_settings(kwargs: dict) -> None:
    """A speculation setting given to `generate` (a keyword, or an entry of its generation config) would be an unused
    model keyword to transformers, or silently ignored: name where it belongs instead (the drafter's generation
    config, which every call with that drafter reads)."""
    given = [name for name in (*SPECULATION_DEFAULTS, *RENAMED_SETTINGS) if name in kwargs]
    if given:
        value, name = kwargs[given[0]], RENAMED_SETTINGS.get(given[0], given[0])
        renamed = f" ({given[0]} is the old name of {name})" if name != given[0] else ""
        raise ValueError(
            f"{', '.join(given)}: speculation settings belong to the drafter, not to one generate() call; set "
            f"drafter.generation_config.{name} = {value!r}{renamed} (it stays for later calls), or load the drafter "
            f"with Eagle3DraftModel.from_pretrained(path, {name}={value!r})")


CONTINUOUS_BATCHING_REFUSAL = (
    "EAGLE drafters are not supported by continuous batching (generate_batch) yet: its paged cache gives each request "
    "one new token per step, and it would ignore the drafter and decode without it. Use "
    "target.generate(input_ids, attention_mask=..., assistant_model=drafter), which also takes a padded batch")


# what makes `generate` decode other than one token a step; each names the settings that ask for it
NOT_PLAIN_MODES = {"beam_search": "num_beams > 1", "beam_sample": "num_beams > 1 with do_sample",
                   "group_beam_search": "num_beam_groups > 1", "constrained_beam_search": "constraints / force_words_ids",
                   "contrastive_search": "penalty_alpha with top_k > 1", "dola_generation": "dola_layers",
                   "assisted_generation": "prompt_lookup_num_tokens / assistant_early_exit / use_mtp"}


def check_plain(generation_config: GenerationConfig) -> None:
    """Refuse, naming the settings, a generation config that asks `fast_decoding` for more than plain greedy or
    sampled decoding: transformers hands a `custom_generate` function every call whatever it asks."""
    mode = generation_config.get_generation_mode()
    if mode in NOT_PLAIN_MODES:
        raise ValueError(f"fast_decoding decodes one token a step (greedy or sampled); this call asks for "
                         f"{mode.replace('_', ' ')} ({NOT_PLAIN_MODES[mode]}): generate without "
                         "custom_generate=hf_eagle31.fast_decoding for it")


@torch.no_grad()
def fast_decoding(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                  generation_config: GenerationConfig, streamer=None, tokenizer=None, compile_step: bool = False,
                  **model_kwargs):
    """Plain decoding (one token a step, no drafter) on this package's fastest forward for the target, passed to
    `generate` as its decoding method:

        out = target.generate(**inputs, max_new_tokens=256, custom_generate=hf_eagle31.fast_decoding)

    On a CPU in fp32 or bf16 each step runs on the CPU backend (the rows kernel or oneDNN's products, and for a
    Llama, Mistral or Qwen2 target the lean forward), elsewhere on transformers' own forward, inside the one
    decoding loop: tokens are picked as plain `generate` picks them (processors, sampling, stopping criteria,
    streamers; the routing hands it the `streamer` and `tokenizer` transformers keeps from `custom_generate`
    functions). The logits come from the products EAGLE verifies with, so greedy output equals plain
    `generate`'s up to near-ties in bf16, as EAGLE's does. Benchmarks compare EAGLE with it as the target's best
    plain decoding. Beam search and the other multi-candidate modes are refused (`check_plain`).

    `compile_step=True` (a keyword of `generate`) runs the lean forward's step as one inductor graph, as a drafter's
    `compile_verify` does for its verify blocks: the first call of a process compiles (a minute or more), later ones
    reuse the graph. Where the lean forward does not serve the target it says so and runs eagerly."""
    check_plain(generation_config)
    check_target(model)
    check_inputs(model, input_ids, generation_config, model_kwargs)
    speculation = plain_speculation(compile_step)
    with eagle_verification(model):
        prepared = prepared_for(model, None, speculation)
        if compile_step and not prepared.compiled:
            warnings.warn("fast_decoding(compile_step=True): this target's step has no compiled forward here (it "
                          "needs the CPU backend's lean forward: a Llama, Mistral or Qwen2 target in fp32 or bf16 on a "
                          "CPU, no hooks or sliding windows), so it runs eagerly", stacklevel=3)
        return eagle_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, None,
                              speculation, prepared, streamer, **model_kwargs)


def plain_speculation(compile_step: bool = False) -> Speculation:
    """`fast_decoding`'s plan: no drafts, "batched" verify forwards of one token, on the CPU backend where it serves
    the target (as `cpu_backend=True` runs a drafter's), compiled with `compile_step`."""
    return Speculation(mode="plain", tree_top_k=1, tree_total_tokens=1, controller=DepthController(1, 1, 1),
                       monitor=CollapseMonitor(enabled=False), verify_chunk_depth=None, verify_mode="batched",
                       cpu_backend=True, compile_verify=compile_step, static_draft=False)


# --- the wrappers `install` puts on GenerationMixin -----------------------------------------------

_ORIGINALS: dict[str, Callable] = {}  # GenerationMixin's own methods by name, as `install` found them


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    """With an EAGLE drafter, refuse speculation settings given to the call and a target EAGLE cannot verify, and
    fit the drafter to the target (`prepare_drafter`), before transformers mistakes a mismatch for a tokenizer
    issue; then transformers' own checks."""
    drafter = generation_mode_kwargs.get("assistant_model")
    if isinstance(drafter, Eagle3DraftModel):
        refuse_call_settings({name: getattr(generation_config, name) for name in NOT_GENERATE_SETTINGS
                              if name in vars(generation_config)})
        check_target(self)
        prepare_drafter(self, drafter)
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


def _assisted_decoding(self, input_ids, *args, **kwargs):
    """With an EAGLE drafter: check the call's inputs, plan it once from the drafter's settings, and decode on the
    backend the plan names (or plainly, where tuning predicted that no draft pays); else transformers' own assisted
    decoding. `generate` fitted the drafter first (`_validate_generation_mode`)."""
    drafter = kwargs.get("assistant_model")
    if not isinstance(drafter, Eagle3DraftModel):
        return _ORIGINALS["_assisted_decoding"](self, input_ids, *args, **kwargs)
    generation_config = kwargs["generation_config"]
    check_inputs(self, input_ids, generation_config, kwargs)
    for unused in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer", "synced_gpus"):
        kwargs.pop(unused, None)
    settings = SpeculationSettings.of(drafter.generation_config)
    speculation = speculation_plan(self, drafter, settings, input_ids, generation_config, kwargs)
    if speculation is None:
        drafter.speculation_stats = SpeculationStats(mode=settings.speculation_mode, fallbacks=1)
        return self._sample(input_ids, *args, **kwargs)
    warn_if_kernel_cannot_run(self, settings, input_ids, kwargs)
    with eagle_verification(self):
        return eagle_decoding(self, input_ids, *args, drafter=drafter, speculation=speculation,
                              prepared=prepared_for(self, drafter, speculation), **kwargs)


def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
    """Refuse speculation settings given to a call with an EAGLE drafter; hand `fast_decoding` the streamer and
    tokenizer transformers keeps from a `custom_generate` function."""
    extract = _ORIGINALS["_extract_generation_mode_kwargs"]
    if isinstance(assistant_model, Eagle3DraftModel):
        refuse_call_settings(kwargs)
    if custom_generate is not fast_decoding:
        return extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
    if assistant_model is not None:
        raise ValueError("fast_decoding decodes without a drafter: pass assistant_model or "
                         "custom_generate=hf_eagle31.fast_decoding, not both")
    tokenizer = kwargs.get("tokenizer")  # for stop_strings; transformers keeps both from a custom_generate
    chosen = extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
    return {**chosen, **{name: value for name, value in (("streamer", streamer), ("tokenizer", tokenizer))
                         if value is not None}}


def generate_batch(self, *args, **kwargs):
    """Refuse an EAGLE drafter in continuous batching, which would silently decode without it."""
    if isinstance(kwargs.get("assistant_model"), Eagle3DraftModel):
        raise NotImplementedError(CONTINUOUS_BATCHING_REFUSAL)
    return _ORIGINALS["generate_batch"](self, *args, **kwargs)


def install() -> None:
    """Put the wrappers above on GenerationMixin in place of the methods that decide how assisted generation runs
    (idempotent). Each keeps its original as `__wrapped__`: transformers reads a decoding method's parameters from
    its signature."""
    if getattr(GenerationMixin._assisted_decoding, "_hf_eagle31", False):
        return
    for wrapper in (_validate_generation_mode, _assisted_decoding, _extract_generation_mode_kwargs, generate_batch):
        _ORIGINALS[wrapper.__name__] = wrapper.__wrapped__ = getattr(GenerationMixin, wrapper.__name__)
        wrapper._hf_eagle31 = True
        setattr(GenerationMixin, wrapper.__name__, wrapper)
