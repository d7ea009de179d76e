"""The EAGLE-3 / EAGLE 3.1 drafter: one draft step, nothing about decoding.

Given token ids shifted one ahead of the features (position t pairs the target's feature at t with
token t+1), one forward of the drafter predicts the token after each position:

    g = fc(concat(norm_a(g_low), norm_b(g_mid), norm_c(g_high)))   # width 3*H_t -> H; norms only in 3.1
    h = g + attention(concat(input_layernorm(embed(x)), hidden_norm(g)))
    h = h + mlp(post_attention_layernorm(h))
    h = plain pre-norm decoder layers(h)                            # only with num_hidden_layers > 1
    logits = lm_head(norm(h))                                       # over the draft vocabulary
    feedback = norm(h) if norm_output else h                        # 3.1 feeds back the post-norm state

Variants that vLLM serves load too: `norm_before_fc` (one norm over the whole concatenation instead
of one per layer), `norm_before_residual` (h starts from hidden_norm(g)), and heads that read n > 3
target layers (width n*H_t).

Module names follow the EAGLE reference checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`),
so those load without renaming.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)
from transformers.utils import ModelOutput

from hf_eagle31.compat import LOAD_KWARGS
from hf_eagle31.configuration import (
    RENAMED_SETTINGS,
    SPECULATION_DEFAULTS,
    Eagle3Config,
    SpeculationSettings,
    safeailab_tree_settings,
    with_new_names,
)
from hf_eagle31.kernels.tree_attention import tree_attention
from hf_eagle31.stats import SpeculationStats

# A device backend's products (hf_eagle31.backends): `products(x, *layers)` is the layers' outputs side by side, or
# None where it has no product for exactly those layers (then they are called as modules)
Products = Callable[..., "torch.Tensor | None"]


def linear_outputs(x: torch.Tensor, *layers: nn.Linear, products: Products | None = None) -> torch.Tensor:
    """The outputs of linear layers that read `x` (q/k/v, gate/up, or one), side by side in the last dimension: a
    backend's one product where it has one, else each layer's own call (its hooks, an adapter's forward)."""
    out = None if products is None else products(x, *layers)
    if out is not None:
        return out
    return layers[0](x) if len(layers) == 1 else torch.cat([layer(x) for layer in layers], dim=-1)


@dataclass
class Eagle3DraftOutput(ModelOutput):
    """`logits` over the draft vocabulary; `hidden_states` is the state to feed to the next draft step."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    cache: Cache | None = None

    @property
    def past_key_values(self) -> Cache | None:
        """`cache` under its name before transformers 5.24, which code written then reads."""
        return self.cache


class Eagle3Attention(nn.Module):
    """Llama attention; in the first layer the q/k/v projections read the concatenated `[embedding, feature]`
    (width 2H), in the layers stacked after it the hidden state (width H)."""

    def __init__(self, config: Eagle3Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        width = (2 if layer_idx == 0 else 1) * config.hidden_size
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        q_width = config.num_attention_heads * self.head_dim
        kv_width = config.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(width, q_width, bias=bias)
        self.k_proj = nn.Linear(width, kv_width, bias=bias)
        self.v_proj = nn.Linear(width, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
        tail_mask: torch.Tensor | None,
        products: Products | None = None,
    ) -> torch.Tensor:
        batch, length = hidden_states.shape[:2]
        heads = linear_outputs(hidden_states, self.q_proj, self.k_proj, self.v_proj, products=products)
        heads = heads.view(batch, length, -1, self.head_dim)  # [B, n, queries + keys + values, D]
        queries = self.q_proj.out_features // self.head_dim
        cos, sin = (part.unsqueeze(2) for part in position_embeddings)
        rotated = heads[:, :, : queries + self.k_proj.out_features // self.head_dim]
        rotated = rotated * cos + rotate_half(rotated) * sin  # queries and keys turned at once (transformers' formula)
        query, key = rotated[:, :, :queries].transpose(1, 2), rotated[:, :, queries:].transpose(1, 2)
        value = heads[:, :, rotated.shape[2] :].transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out = tree_attention(query, key, value, tail_mask, self.scaling)
        return linear_outputs(out.transpose(1, 2).reshape(batch, length, -1), self.o_proj, products=products)


def gated_mlp(mlp: LlamaMLP, x: torch.Tensor, products: Products | None = None) -> torch.Tensor:
    """`mlp(x)`, its gate and up projections as one product where `products` has one."""
    gate, up = linear_outputs(x, mlp.gate_proj, mlp.up_proj, products=products).split(mlp.intermediate_size, dim=-1)
    return linear_outputs(mlp.act_fn(gate) * up, mlp.down_proj, products=products)


class Eagle3DecoderLayer(nn.Module):
    """The first (usually the only) decoder layer; the residual stream is the projected target feature, not the
    embedding."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
        tail_mask: torch.Tensor | None,
        products: Products | None = None,
    ) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        attn_in = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + self.self_attn(attn_in, position_embeddings, cache, tail_mask, products)
        return hidden + gated_mlp(self.mlp, self.post_attention_layernorm(hidden), products)


class StackedDecoderLayer(nn.Module):
    """A plain pre-norm Llama layer stacked after the first (`num_hidden_layers` > 1): more capacity on the same
    features, for one more layer's work at each draft level. Its keys are `layers.{i}.*` (i >= 1); the engines' EAGLE-3
    layouts carry one layer, so a head with more saves in this project's layout only (`unrepresentable`)."""

    def __init__(self, config: Eagle3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: Cache | None,
        tail_mask: torch.Tensor | None,
        products: Products | None = None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), position_embeddings, cache, tail_mask, products)
        return hidden + gated_mlp(self.mlp, self.post_attention_layernorm(hidden), products)


_STATS: weakref.WeakKeyDictionary[nn.Module, threading.local] = weakref.WeakKeyDictionary()  # drafter -> per thread


class Eagle3DraftModel(PreTrainedModel):
    """An EAGLE-3 drafter (both 3.1 switches off) or an EAGLE 3.1 drafter (`fc_norm`, `norm_output`)."""

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    main_input_name = "input_ids"
    _no_split_modules = ["Eagle3DecoderLayer", "StackedDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        target_width, layers = config.target_hidden_size, config.num_aux_hidden_states
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
            if config.include_embedding
            else None
        )
        self.fc_norm = (
            nn.ModuleList(LlamaRMSNorm(target_width, eps=config.rms_norm_eps) for _ in range(layers))
            if config.fc_norm
            else None
        )
        self.input_norm = LlamaRMSNorm(layers * target_width, eps=config.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(layers * target_width, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.layers = nn.ModuleDict({str(i): StackedDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)})
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self._target_embedding: list[nn.Embedding] = []  # a plain list: shared, never registered or saved
        self._rotary_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # `rotary_at`'s, never saved
        self.generation_config = GenerationConfig(**SPECULATION_DEFAULTS)  # how generate() speculates
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self:  # identity vocabulary map until a real one is loaded or built
            self.d2t.zero_()
            self.t2d.zero_()
            self.t2d[: self.config.draft_vocab_size] = True

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """What this thread's last `generate` call with this drafter did (each call records its own: threads that
        share a drafter do not see each other's; `return_dict_in_generate=True` returns it with the output)."""
        return getattr(_STATS.get(self), "stats", None)

    @speculation_stats.setter
    def speculation_stats(self, stats: SpeculationStats) -> None:
        _STATS.setdefault(self, threading.local()).stats = stats

    # --- saving and loading: the speculation settings travel with the weights ---------------

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        self.generation_config.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_pickle: bool = False,
                        total_token: int | None = None, depth: int | None = None, top_k: int | None = None, **kwargs):
        """Load a drafter in any layout: this project's, the EAGLE reference's, SpecForge's or speculators'.

        The layout is detected from the config and keys and read into this project's key names
        (`hf_eagle31.conversion.layouts`), checked key by key and shape by shape (this project's own
        layout as strictly as the others: a missing or renamed tensor is an error, not a random
        one), then built by transformers from that state dict, so `dtype` and `device_map` mean what
        they mean for any model. `pytorch_model.bin` files are read only with `allow_pickle=True`.
        `total_token`, `depth` and `top_k` are SafeAILab `EaModel.from_pretrained`'s tree settings, with
        SafeAILab's meaning (`configuration.safeailab_tree_settings`); given, they select tree mode in that shape.
        This project's speculation settings (`SPECULATION_DEFAULTS`: `tree_depth=3`, `speculation_mode="chain"`,
        ...) override the saved generation config, checked as `generate` checks them.
        """
        from hf_eagle31.conversion import layouts

        speculation = with_new_names({name: kwargs.pop(name) for name in (*SPECULATION_DEFAULTS, *RENAMED_SETTINGS)
                                      if name in kwargs}, "from_pretrained")

        hub_kwargs = {k: kwargs.pop(k) for k in layouts.HUB_KWARGS if k in kwargs}
        folder = layouts.checkpoint_folder(pretrained_model_name_or_path, **hub_kwargs)
        config, state, layout = layouts.read_checkpoint(folder, allow_pickle)
        given = kwargs.pop("config", None)  # AutoModel passes the config it read: ours, for our own layout
        config = given if isinstance(given, Eagle3Config) else config
        with torch.device("meta"):
            expected = cls(config).state_dict()
        layouts.check_state_dict(expected, state, f"{pretrained_model_name_or_path} ({layout} layout)", config)
        model = super().from_pretrained(None, *args, config=config, state_dict=state, **{**LOAD_KWARGS, **kwargs})
        file = folder / "generation_config.json"  # none: the defaults; a damaged one is named, not skipped
        saved = GenerationConfig.from_dict(layouts.read_json(file)).to_diff_dict() if file.is_file() else {}
        saved = with_new_names(saved, str(file))  # saved before a setting was renamed
        tree = safeailab_tree_settings(total_token, depth, top_k)
        if tree and speculation:
            raise ValueError(f"give the tree settings in SafeAILab's names (total_token, depth, top_k) or in this "
                             f"project's ({', '.join(speculation)}), not both: they count the tree differently")
        tree = {"speculation_mode": "tree", **tree} if tree else {}
        model.generation_config = GenerationConfig(**{**SPECULATION_DEFAULTS, **saved, **tree, **speculation})
        SpeculationSettings.of(model.generation_config)  # checked here, not first met by a generate call
        return model

    # --- the target's embedding -------------------------------------------------------------

    def set_target_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's input embedding by reference; drop the checkpoint's own copy to save memory."""
        rows, width = embedding.weight.shape
        if rows < self.config.vocab_size or width != self.config.hidden_size:
            raise ValueError(
                f"The target's input embedding is {rows} x {width}, but this drafter expects a vocabulary of "
                f"{self.config.vocab_size} tokens of width {self.config.hidden_size}."
            )
        self._target_embedding[:] = [embedding]
        if self.embed_tokens is not None:
            self.embed_tokens = None
            self.config.include_embedding = False

    def get_input_embeddings(self) -> nn.Embedding | None:
        if self._target_embedding:
            return self._target_embedding[0]
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.set_target_embedding(value)

    # --- vocabulary maps --------------------------------------------------------------------

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (`target = draft + d2t[draft]`)."""
        return draft_ids + self.d2t[draft_ids]

    def expand_to_target_vocab(self, draft_logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Scatter draft-vocabulary logits (or, with `fill=0`, probabilities) into a full target-vocabulary
        tensor, `fill` outside the draft vocab."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), fill)
        index = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        return full.index_copy_(-1, index, draft_logits)

    # --- one draft step ---------------------------------------------------------------------

    def rotary_at(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin at `position_ids` in `like`'s dtype (`rotary_rows`). Why: computing them
        at each draft level was a sixth of the small operations a level runs outside its products, each a fixed cost
        on a CPU."""
        return rotary_rows(self.rotary_emb, like, position_ids, self._rotary_tables)

    def project_target_features(self, features: torch.Tensor, products: Products | None = None) -> torch.Tensor:
        """Fuse the captured target states (concatenated, width n*H_t) into one drafter state."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return linear_outputs(features, self.fc, products=products)

    def forward(
        self,
        input_ids: torch.LongTensor,
        hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        tail_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        logits_at: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        products: Products | None = None,
        *,
        past_key_values: Cache | None = None,
    ) -> Eagle3DraftOutput:
        """One draft step for a block of positions.

        Args:
            input_ids: `[batch, n]` target-vocabulary ids, one ahead of `hidden_states`.
            hidden_states: `[batch, n, k * target_hidden_size]` features of the k captured target layers, or
                `[batch, n, hidden_size]` states fed back from a previous draft step.
            position_ids: `[batch, n]`; defaults to continuing after the cache.
            cache: the drafter's own cache (a transformers `Cache`), updated in place.
            tail_mask: `[n, m]` bool visibility of the last `m` cache entries (see `tree_attention`);
                `None` is causal.
            logits_to_keep: compute logits for the last this many positions only (0: all). Catching
                up on a long prompt needs just the last: `n x V_d` logits would be the largest tensor.
            logits_at: `[batch, n]` bool: logits only there, flattened to `[count, V_d]` (training needs them
                only where its loss counts, and the head over a 16k+ vocabulary is most of a step's cost); or a
                pair of index tensors (rows, positions) `[count]` each, which reads no count back from the device.
            products: a device backend's products for this drafter's linear layers (hf_eagle31.backends), which
                compute what the layers' own calls would; None: the layers' own calls.
            past_key_values: `cache` under its name before transformers 5.24, which code written then (training
                loops, harnesses calling a loaded head) passes, as transformers' own models still accept it.
        """
        if past_key_values is not None:
            if cache is not None:
                raise ValueError("the drafter got both cache= and past_key_values= (the same argument, by its name "
                                 "before transformers 5.24): pass the cache once, as cache=")
            cache = past_key_values
        width, captured = hidden_states.shape[-1], self.fc.in_features
        if width == captured:
            hidden_states = self.project_target_features(hidden_states, products)
        elif width != self.config.hidden_size:
            raise ValueError(
                f"hidden_states has width {width}; expected {self.config.num_aux_hidden_states} captured layers x "
                f"target_hidden_size = {captured} (target features) or hidden_size = "
                f"{self.config.hidden_size} (fed-back drafter states)."
            )
        embedding = self.get_input_embeddings()
        if embedding is None:
            raise ValueError(
                "This drafter has no input embedding: its checkpoint shares the target's. Call "
                "`drafter.set_target_embedding(target.get_input_embeddings())` first (generate() does this)."
            )
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        embeds = embedding(input_ids).to(hidden_states.dtype)
        position_embeddings = self.rotary_at(hidden_states, position_ids)
        hidden = self.midlayer(embeds, hidden_states, position_embeddings, cache, tail_mask, products)
        for layer in self.layers.values():
            hidden = layer(hidden, position_embeddings, cache, tail_mask, products)
        normed = self.norm(hidden)
        return Eagle3DraftOutput(
            logits=linear_outputs(normed[logits_at] if logits_at is not None else normed[:, -logits_to_keep:],
                                  self.lm_head, products=products),
            hidden_states=normed if self.config.norm_output else hidden,
            cache=cache,
        )


def route_auto_classes() -> None:
    """Make `AutoModel.from_pretrained(<EAGLE-3 head in any layout>)` return the drafter (the README's line).

    EAGLE reference and SpecForge heads say `model_type: "llama"`, so transformers alone builds a
    `LlamaModel` from them (random weights where the head's are, and `generate` then fails on it);
    speculators heads have no `model_type` at all. Both are recognised by their config here and
    loaded as drafters; `AutoModelForCausalLM` refuses them by name, since a drafter is not a
    language model. Every other checkpoint goes to transformers untouched.
    """
    for auto_class in (AutoModel, AutoModelForCausalLM):
        original = auto_class.from_pretrained.__func__
        if not getattr(original, "routes_eagle_heads", False):
            auto_class.from_pretrained = classmethod(_routed(original))


def _routed(original):
    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from hf_eagle31.conversion import layouts

        config = None if kwargs.get("config") else layouts.peek_config(pretrained_model_name_or_path, kwargs)
        if config is None or not layouts.is_foreign_drafter(config):
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        if cls is not AutoModel:
            raise layouts.CheckpointError(
                f"{pretrained_model_name_or_path} is an EAGLE-3 drafter head (architectures "
                f"{config.get('architectures')}), not a model {cls.__name__} can build: load it with "
                "`AutoModel.from_pretrained(...)` after `import hf_eagle31` (or `hf_eagle31.Eagle3DraftModel"
                ".from_pretrained(...)`) and pass it to `target.generate(..., assistant_model=drafter)`"
            )
        return Eagle3DraftModel.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    from_pretrained.routes_eagle_heads = True
    return from_pretrained


__all__ = ["Eagle3DraftModel", "Eagle3DraftOutput", "route_auto_classes"]


def rotary_rows(rotary: nn.Module, like: torch.Tensor, position_ids: torch.Tensor, tables: dict,
                below: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding's cos and sin `[B, n, D]` at `position_ids` `[B, n]` in `like`'s dtype; on a CPU, rows of
    a table of them that it computed once for positions 0..L-1 (kept in `tables`, grown by doubling): the same
    numbers, each being one position times one frequency. `below`, where the caller knows it: a bound on the
    positions, so that sizing the table reads none of them. Types that change with the length (dynamic, longrope)
    compute them at each call, and so does CUDA (sizing the table would wait for the device)."""
    if like.device.type != "cpu" or "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
        return rotary(like, position_ids)
    key = (like.dtype, rotary.inv_freq.data_ptr())
    cos, sin = tables.get(key, (None, None))
    needed = int(position_ids.max()) + 1 if below is None else below
    if cos is None or cos.shape[0] < needed:
        length = max(needed, 2 * (0 if cos is None else cos.shape[0]), 256)
        cos, sin = (part[0] for part in rotary(like, torch.arange(length, device=like.device)[None]))
        tables[key] = cos, sin
    return cos[position_ids], sin[position_ids]
