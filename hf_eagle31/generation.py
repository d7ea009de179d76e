"""EAGLE decoding behind `target.generate(..., assistant_model=drafter)`.

Two modes, chosen by `drafter.generation_config.speculation_mode`:
  * "chain": transformers' own assisted-decoding loop verifies a chain proposed by
    `EagleCandidateGenerator`, which receives the target's selected hidden states through the
    `requires_model_outputs` / `model_kwargs_overrides` extension points.
  * "tree": `eagle_tree_decoding`, a loop of our own (a chain loop cannot express a tree) that
    drafts an EAGLE-2 dynamic tree and verifies it in one target forward.

transformers has no registry for third-party candidate generators, so importing hf_eagle31 wraps
five `GenerationMixin` methods (`install`). Each wrapper acts only when `assistant_model` is an
`Eagle3DraftModel` and otherwise calls the original with the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_eagle31.batched import eagle_batched_decoding
from hf_eagle31.configuration import SPECULATION_DEFAULTS, default_target_layer_ids
from hf_eagle31.control import CollapseMonitor, LengthController, draft_depth
from hf_eagle31.drafting import DrafterState, DraftTree, draft_chain, draft_tree
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.kernels.tree_attention import require_triton
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.packing import packed_weights
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.verification import (
    VERIFY_MODES,
    UnsupportedTargetError,
    VerifyPlan,
    exact_mode_hooks,
    has_sliding_window,
    leave_exact_mode,
    pick_token,
    verify_tree,
    verifying_attention,
)


POSITIVE_SETTINGS = {"num_assistant_tokens": 64, "tree_depth": 64, "tree_top_k": 64, "tree_total_tokens": 1024,
                     "max_speculation_depth": 64, "verify_chunk_depth": 64}  # name -> largest value accepted
CHOICES = {"speculation_mode": ("chain", "tree"), "verify_mode": VERIFY_MODES}
SWITCHES = ("dynamic_speculation", "collapse_fallback", "pack_weights")


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


def key_padding(model_kwargs: dict) -> torch.Tensor | None:
    """The prompt's attention mask as `[length]` bool (False for a pad), or None when nothing is padded."""
    mask = model_kwargs.get("attention_mask")
    return None if mask is None or bool(mask.all()) else mask[0].bool()


def without_padding(features: torch.Tensor, next_tokens: torch.Tensor, padding: torch.Tensor | None):
    """The last `features.shape[1]` prompt positions that are real tokens (a pad's feature is nothing to draft from)."""
    if padding is None:
        return features, next_tokens
    real = padding[-features.shape[1] :]
    return features[:, real.to(features.device)], next_tokens[:, real.to(next_tokens.device)]


def _draft_sampler(drafter: Eagle3DraftModel, do_sample: bool, temperature: float):
    """How the drafter picks a draft token: argmax, or a sample from its temperature-scaled distribution."""

    def choose(draft_logits: torch.Tensor) -> torch.Tensor:
        if not do_sample:
            return drafter.draft_to_target(draft_logits.argmax(dim=-1, keepdim=True))
        probs = torch.softmax(draft_logits.float() / temperature, dim=-1)
        return drafter.draft_to_target(torch.multinomial(probs, 1))

    return choose


class EagleCandidateGenerator(CandidateGenerator):
    """Chain drafting for transformers' assisted-decoding loop.

    The loop hands us the target's last forward output; we take the captured features of the
    positions it accepted, feed them to the drafter (which drops the entries of the previous,
    rejected draft), and draft the next chain. With sampling we return the drafter's logits over the
    full target vocabulary so that transformers' speculative sampling can use them as q.
    """

    requires_model_outputs = True

    def __init__(self, target: PreTrainedModel, drafter: Eagle3DraftModel, generation_config: GenerationConfig,
                 tokenizer=None):
        prepare_drafter(target, drafter)
        self.drafter = drafter
        self.layer_ids = drafter.config.target_layer_ids
        self.mode = verify_mode(drafter)
        self.model_kwargs_overrides = {"output_hidden_states": capture_request(self.layer_ids), "eagle_verify_plan": None}
        self.state = DrafterState(drafter)
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = generation_config.temperature or 1.0
        self.choose = _draft_sampler(drafter, self.do_sample, self.temperature)
        self.max_length = generation_config.max_length
        # transformers checks stopping criteria after a whole step (and, before 5.23, does not cut
        # the accepted tokens at eos): a stop inside an accepted draft would let later tokens
        # through. Drafts therefore end before any eos token or token completing a stop string, so
        # a stop can only fall on a step's last token, where it is seen.
        eos = generation_config.eos_token_id
        self.eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long)
        self.stop_strings = (
            StopStringCriteria(tokenizer, generation_config.stop_strings)
            if generation_config.stop_strings and tokenizer is not None
            else None
        )
        self.controller = _length_controller(drafter, speculation_setting(drafter, "num_assistant_tokens"))
        self.monitor = CollapseMonitor(enabled=bool(speculation_setting(drafter, "collapse_fallback")))
        self.stats = SpeculationStats(mode="chain")
        drafter.speculation_stats = self.stats
        self.prefilled = False
        self.key_padding: torch.Tensor | None = None
        self.proposed = 0
        self.step_started = 0.0
        self.draft_seconds = 0.0

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        self.model_kwargs_overrides["eagle_verify_plan"] = None
        if is_first_iteration:  # transformers' loop prefills first; we draft from its hidden states
            self.key_padding = key_padding(model_kwargs)
            self.proposed = -1
            return input_ids, None
        features = select_features(model_outputs.hidden_states, self.layer_ids)
        if self.prefilled:
            self.state.push(features[:, : n_last_matches + 1], input_ids[:, -n_last_matches - 1 :])
        else:
            self.state.push(*without_padding(features, input_ids[:, -features.shape[1] :], self.key_padding))
            self.prefilled = True
        self.step_started = time.perf_counter()
        steps = draft_depth(self.controller.length, input_ids.shape[1], self.max_length)
        if steps <= 0 or not self.monitor.should_speculate():
            self.proposed = 0
            return input_ids, None
        tokens, draft_logits = draft_chain(self.state, steps, self.choose)
        # with sampling, transformers' speculative sampling needs q over the full target vocabulary
        logits = self.drafter.expand_to_target_vocab(draft_logits.float() / self.temperature) if self.do_sample else None
        tokens, logits = self._cut_before_stop(input_ids, tokens, logits)
        self.proposed = tokens.shape[1]
        self.draft_seconds = time.perf_counter() - self.step_started
        if not self.proposed:  # the first draft token would stop: a plain step (no empty `[1, 0, V]` logits)
            return input_ids, None
        plan = VerifyPlan.causal(self.proposed + 1, input_ids.device, model_kwargs["past_key_values"], self.mode,
                                 self.key_padding)
        self.model_kwargs_overrides["eagle_verify_plan"] = plan
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=1), logits

    def _cut_before_stop(self, input_ids, tokens, logits):
        """End the draft before its first token that would stop generation.

        With sampling, whether the draft continues past a position then depends on the token drawn
        there, so the proposal at each kept position is q conditioned on not stopping: the returned
        logits mask the stopping tokens, which keeps speculative sampling exact.
        """
        if not len(self.eos) and self.stop_strings is None:
            return tokens, logits
        cut = lambda j: (tokens[:, :j], None if logits is None else logits[:, :j])  # noqa: E731
        sequence = torch.cat([input_ids, tokens.to(input_ids.device)], dim=1)
        start = input_ids.shape[1]
        for j in range(tokens.shape[1]):
            if self.do_sample:
                stops = self._stopping_tokens(sequence[:, : start + j]).to(logits.device)
                logits[:, j, stops] = float("-inf")
                hit = bool(stops[tokens[0, j]])
            else:
                hit = bool(torch.isin(tokens[0, j].cpu(), self.eos)) or (
                    self.stop_strings is not None and bool(self.stop_strings(sequence[:, : start + j + 1], None).any())
                )
            if hit:
                return cut(j)
        return tokens, logits

    def _stopping_tokens(self, prefix: torch.Tensor) -> torch.Tensor:
        """`[V]` bool: the tokens that, appended to `prefix`, end generation (eos or a completed stop string)."""
        vocab = self.drafter.config.vocab_size
        stops = torch.zeros(vocab, dtype=torch.bool)
        stops[self.eos] = True
        if self.stop_strings is not None:
            tail = prefix[:, -self.stop_strings.maximum_token_len :].cpu().expand(vocab, -1)
            stops |= self.stop_strings(torch.cat([tail, torch.arange(vocab)[:, None]], dim=1), None).cpu()
        return stops

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        seconds = time.perf_counter() - self.step_started
        num_matches = int(num_matches)
        if self.proposed < 0:  # the prefill
            return
        if self.proposed == 0:
            self.stats.plain_steps += 1
            self.stats.plain_seconds += seconds
            self.monitor.record_plain(seconds)
            return
        verify_seconds = seconds - self.draft_seconds
        self.stats.draft_seconds += self.draft_seconds
        self.stats.verify_seconds += verify_seconds
        self.stats.record_step(self.proposed, num_matches, num_matches + 1)
        self.controller.update(self.proposed, num_matches)
        self.monitor.record_speculative(num_matches + 1, seconds, verify_seconds)
        self.stats.fallbacks = self.monitor.fallbacks


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


def check_inputs(target: PreTrainedModel, input_ids: torch.Tensor, mode: str, generation_config, model_kwargs) -> None:
    """Refuse, by name and before any work, what EAGLE decoding cannot do exactly."""
    check_positions(target, input_ids.shape[1], generation_config.max_length)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError("EAGLE decoding needs left-padded prompts (tokenizer.padding_side = 'left'); these are "
                         "right-padded, which plain generate too decodes wrongly (it continues from the pads)")
    if generation_config.guidance_scale not in (None, 1) and (mode == "chain" or input_ids.shape[0] > 1):
        raise ValueError("EAGLE decoding supports classifier-free guidance (guidance_scale) only in tree mode with "
                         "one prompt: its processor runs the target on one sequence, one token at a time")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("EAGLE decoding cannot return attentions or hidden states (output_attentions / "
                         "output_hidden_states); generate without the drafter for those")
    if generation_config.use_cache is False:
        raise ValueError("EAGLE decoding needs the KV cache: use_cache=False is not supported")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("EAGLE decoding needs token ids (the drafter embeds them): pass input_ids, not inputs_embeds")
    cache = model_kwargs.get("past_key_values")
    if generation_config.cache_implementation not in (None, "dynamic") or (
            cache is not None and not isinstance(cache, DynamicCache)):
        raise ValueError("EAGLE decoding rolls rejected drafts back in a DynamicCache; got cache_implementation="
                         f"{generation_config.cache_implementation!r} / {type(cache).__name__}")


@torch.no_grad()
def eagle_tree_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    drafter: Eagle3DraftModel,
    streamer=None,
    **model_kwargs,
):
    """Draft a tree, verify it in one target forward, accept the longest valid path, repeat.

    Runs inside `eagle_verification(model)` (the `generate` routing takes care of it).
    """
    prepare_drafter(model, drafter)
    layer_ids = drafter.config.target_layer_ids
    cache = model_kwargs["past_key_values"]
    state = DrafterState(drafter)
    stats = SpeculationStats(mode="tree")
    drafter.speculation_stats = stats
    controller = _length_controller(drafter, speculation_setting(drafter, "tree_depth"))
    monitor = CollapseMonitor(enabled=bool(speculation_setting(drafter, "collapse_fallback")))
    top_k = speculation_setting(drafter, "tree_top_k")
    total_tokens = speculation_setting(drafter, "tree_total_tokens")
    chunk_depth = speculation_setting(drafter, "verify_chunk_depth")
    mode = verify_mode(drafter)
    do_sample = bool(generation_config.do_sample)
    scores_out = [] if generation_config.return_dict_in_generate and generation_config.output_scores else None
    logits_out = [] if generation_config.return_dict_in_generate and generation_config.output_logits else None
    sequence = [input_ids]

    def emit(node: int, logits: torch.Tensor) -> tuple[int, bool]:
        """Pick the next token from the target's logits exactly as plain `generate` does, and record it."""
        ids = torch.cat(sequence, dim=1) if len(sequence) > 1 else sequence[0]
        scores = logits_processor(ids, logits[None])
        token = pick_token(scores, do_sample)
        sequence[:] = [torch.cat([ids, token], dim=1)]
        if scores_out is not None:
            scores_out.append(scores)
        if logits_out is not None:
            logits_out.append(logits[None])
        stop = bool(stopping_criteria(sequence[0], scores).any())
        return int(token), stop

    start = cache.get_seq_length()
    padding = key_padding(model_kwargs)
    masking = {}
    if padding is not None:  # as plain generate does: the mask, and positions that count real tokens only
        positions = (padding.long().cumsum(-1) - 1).masked_fill(~padding, 0)
        masking = {"attention_mask": model_kwargs["attention_mask"], "position_ids": positions[None, start:]}
    out = model(
        input_ids=input_ids[:, start:],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=capture_request(layer_ids),
        logits_to_keep=1,
        **masking,
    )
    token, stop = emit(0, out.logits[0, -1].float())
    state.push(*without_padding(select_features(out.hidden_states, layer_ids), sequence[0][:, start + 1 :], padding))
    streamed = input_ids.shape[1]
    if streamer is not None:
        streamer.put(sequence[0][:, streamed:].cpu())
        streamed += 1
    while not stop:
        root = sequence[0][0, -1:]
        began = time.perf_counter()
        depth = draft_depth(controller.length, sequence[0].shape[1], generation_config.max_length)
        speculate = monitor.should_speculate()
        if speculate and depth > 0:
            tree = draft_tree(state, root, depth, top_k, total_tokens)[0]
        else:
            tree = DraftTree.root_only(root)
        drafted = time.perf_counter()
        result = verify_tree(model, cache, tree, layer_ids, emit, state.push, chunk_depth, mode, padding)
        stop = result.stopped
        done = time.perf_counter()
        if speculate:
            stats.draft_seconds += drafted - began
            stats.verify_seconds += done - drafted
            ranks = tree.ranks[result.path].tolist()
            stats.record_step(tree.depth, result.accepted, len(result.tokens), result.forwards, ranks)
            controller.update(tree.depth, result.accepted)
            monitor.record_speculative(len(result.tokens), done - began, done - drafted)
            stats.fallbacks = monitor.fallbacks
        else:
            stats.plain_steps += 1
            stats.plain_seconds += done - began
            monitor.record_plain(done - began)
        if streamer is not None:
            streamer.put(sequence[0][:, streamed:].cpu())
            streamed = sequence[0].shape[1]
    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return sequence[0]
    return GenerateDecoderOnlyOutput(
        sequences=sequence[0],
        scores=tuple(scores_out) if scores_out is not None else None,
        logits=tuple(logits_out) if logits_out is not None else None,
        past_key_values=cache,
    )


def batch_shape(drafter: Eagle3DraftModel, batch_size: int) -> dict | None:
    """The tuned shape for the largest tuned batch size up to `batch_size` (`tuning.batch_shapes`), if any."""
    shapes = getattr(drafter.generation_config, "batch_shapes", None) or {}
    fitting = [int(size) for size in shapes if int(size) <= batch_size]
    return shapes[str(max(fitting))] if fitting else None


def batched_decoding(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                     generation_config: GenerationConfig, drafter: Eagle3DraftModel, mode: str, **model_kwargs):
    """More than one prompt: `eagle_batched_decoding` with the drafter's speculation settings, or with the
    shape tuned for this batch size; plain decoding where tuning predicted that no shape pays at this size."""
    prepare_drafter(model, drafter)
    shape = batch_shape(drafter, input_ids.shape[0])
    if shape is not None and shape["speedup"] < 1.0:
        drafter.speculation_stats = SpeculationStats(mode=mode, fallbacks=1)
        return model._sample(input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
    monitor = CollapseMonitor(enabled=bool(speculation_setting(drafter, "collapse_fallback")))
    monitor.plain_left = 1  # time a plain step of this batch first: it is what speculation must beat
    settings = {name: speculation_setting(drafter, name) for name in
                ("tree_top_k", "tree_depth", "tree_total_tokens", "num_assistant_tokens")}
    if shape is not None:
        mode = "chain" if shape["tree_top_k"] == 1 else "tree"
        settings.update({k: shape[k] for k in ("tree_top_k", "tree_depth", "tree_total_tokens")},
                        num_assistant_tokens=shape["tree_depth"])
    return eagle_batched_decoding(
        model, input_ids, logits_processor, stopping_criteria, generation_config, drafter, mode,
        top_k=settings["tree_top_k"],
        total_tokens=settings["tree_total_tokens"],
        choose=_draft_sampler(drafter, bool(generation_config.do_sample), generation_config.temperature or 1.0),
        controller=_length_controller(drafter, settings["tree_depth" if mode == "tree" else "num_assistant_tokens"]),
        monitor=monitor,
        **model_kwargs)


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
    candidates = GenerationMixin._get_candidate_generator
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
        mode = speculation_setting(drafter, "speculation_mode")
        check_inputs(self, input_ids, mode, kwargs["generation_config"], kwargs)
        pack = packs_weights(drafter)
        with eagle_verification(self), packed_weights(self, pack), packed_weights(drafter, pack):
            if mode == "chain" and input_ids.shape[0] == 1:
                return assisted(self, input_ids, *args, **kwargs)
            for unused in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer", "synced_gpus"):
                kwargs.pop(unused, None)
            if input_ids.shape[0] == 1:
                return eagle_tree_decoding(self, input_ids, *args, drafter=drafter, **kwargs)
            return batched_decoding(self, input_ids, *args, drafter=drafter, mode=mode, **kwargs)

    @functools.wraps(candidates)
    def _get_candidate_generator(self, *args, **kwargs):
        drafter = kwargs.get("assistant_model")
        if isinstance(drafter, Eagle3DraftModel):
            return EagleCandidateGenerator(self, drafter, kwargs["generation_config"], kwargs.get("target_tokenizer"))
        return candidates(self, *args, **kwargs)

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

    for wrapper in (_validate_generation_mode, _assisted_decoding, _get_candidate_generator, generate_batch,
                    _extract_generation_mode_kwargs):
        wrapper._hf_eagle31 = True
        setattr(GenerationMixin, wrapper.__name__, wrapper)
