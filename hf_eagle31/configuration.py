"""The drafter's configuration: one Llama-style decoder layer plus the EAGLE-3 / 3.1 specifics."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedConfig

MODEL_TYPE = "eagle3_drafter"

# Speculation settings read from the drafter's generation config (attribute -> default).
SPECULATION_DEFAULTS: dict[str, Any] = {
    "speculation_mode": "tree",  # "tree" or "chain"
    "num_assistant_tokens": 5,  # chain length
    "tree_depth": 6,
    "tree_top_k": 10,
    "tree_total_tokens": 60,
    "dynamic_speculation": True,  # PID control of the chain length / tree depth
    "max_speculation_depth": 10,
    "collapse_fallback": True,  # fall back to plain decoding when speculation does not pay
    "verify_chunk_depth": None,  # micro-batched tree verification: levels per target forward
    # how a verify forward is computed (see verify_plan.VerifyPlan): "batched" (one SDPA call with
    # the tree mask), "kernel" (the Triton tree-attention kernel on CUDA) or "exact" (bit-identical
    # to one-token decoding on any device, at a higher verify cost)
    "verify_mode": "batched",
    # on a CPU, the CPU backend (hf_eagle31/backends/cpu): products for a few rows at the memory's rate, held beside
    # the models; verifying a few tokens then costs about one plain step; not with "exact" verification
    "cpu_backend": True,
    # on the CPU backend, a Llama-family target's verify forward compiled by inductor (backends/cpu/lean.py):
    # cheaper, after a first call that compiles for minutes (and again, for less, in each new process)
    "compile_verify": False,
    # how a tree is drafted: "narrowed" (each level only as wide as nodes the tree may still keep, stopping early:
    # the host reads scores back between levels), "static" (every level of a shape the same tensors, nothing read
    # back; a CUDA drafter replays each shape as a CUDA graph), "auto" (static on CUDA, narrowed elsewhere)
    "draft_mode": "auto",
}


POSITIVE_SETTINGS = {"num_assistant_tokens": 64, "tree_depth": 64, "tree_top_k": 64, "tree_total_tokens": 1024,
                     "max_speculation_depth": 64, "verify_chunk_depth": 64}  # name -> largest value accepted
VERIFY_MODES = ("batched", "kernel", "exact")
DRAFT_MODES = ("auto", "narrowed", "static")
CHOICES = {"speculation_mode": ("chain", "tree"), "verify_mode": VERIFY_MODES, "draft_mode": DRAFT_MODES}
SWITCHES = ("dynamic_speculation", "collapse_fallback", "cpu_backend", "compile_verify")
# renamed settings, old name -> new name: the old one is still read, with a FutureWarning, until hf_eagle31 0.2
RENAMED_SETTINGS = {"pack_weights": "cpu_backend"}


def _warn_renamed(old: str, new: str, where: str) -> None:
    warnings.warn(f"the speculation setting {old} ({where}) is now called {new}, the same setting; {old} is read as "
                  f"{new} until hf_eagle31 0.2, which drops it: set {new} instead", FutureWarning, stacklevel=4)


def with_new_names(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """`settings` (given to `from_pretrained`, or saved in `where`) with each renamed one under its new name, said
    with a FutureWarning; the old and the new name of one setting at once is an error."""
    settings = dict(settings)
    for old, new in RENAMED_SETTINGS.items():
        if old in settings:
            if new in settings:
                raise ValueError(f"{where} gives both {old}={settings[old]!r} and {new}={settings[new]!r}: {old} is "
                                 f"the old name of {new}; give {new} alone")
            _warn_renamed(old, new, where)
            settings[new] = settings.pop(old)
    return settings


def _move_renamed(config) -> None:
    """A renamed setting set on a generation config by its old name moves to its new name (said with a
    FutureWarning), replacing the new one's value: a drafter's config always holds the new name (its default
    included), so the old one is the one set by hand."""
    for old, new in RENAMED_SETTINGS.items():
        value = vars(config).pop(old, _UNSET)
        if value is not _UNSET:
            _warn_renamed(old, new, "set on a generation config")
            setattr(config, new, value)


_UNSET = object()


def _checked(config, name: str) -> Any:
    """One setting from a generation config (the default when unset), checked: a misspelt mode or an impossible
    size is named here, not met as a wrong mode or a torch error later."""
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


@dataclass(frozen=True)
class TunedShape:
    """A draft shape tuning chose for one kind of call (hf_eagle31.tuning), and the speedup it predicted for it;
    saved in the drafter's generation config as a dict of these fields."""

    tree_top_k: int  # 1: a chain
    tree_depth: int
    tree_total_tokens: int
    speedup: float  # below 1: no shape pays for this kind of call, which then decodes without drafting

    @classmethod
    def parse(cls, value: Any, name: str) -> TunedShape | None:
        if value is None:
            return None
        sizes = ("tree_top_k", "tree_depth", "tree_total_tokens")
        if not (isinstance(value, dict) and all(isinstance(value.get(size), int) and value[size] >= 1 for size in sizes)
                and isinstance(value.get("speedup"), (int, float))):
            raise ValueError(f"{name} holds {value!r}; a tuned shape is a dict of positive integers tree_top_k, "
                             "tree_depth and tree_total_tokens and a predicted speedup (see hf_eagle31.tuning), "
                             f"or set {name} to None")
        return cls(*(value[size] for size in sizes), float(value["speedup"]))


@dataclass(frozen=True)
class SpeculationSettings:
    """How a drafter speculates, read once from its generation config (where the settings are saved with it) and
    checked there. Every `generate` call, `from_pretrained`, tuning and the command read them through this.
    The defaults and their meanings: `SPECULATION_DEFAULTS` and the README's settings table."""

    speculation_mode: str
    num_assistant_tokens: int
    tree_depth: int  # with dynamic_speculation, the depth drafting starts at (then moved within 1..max)
    tree_top_k: int
    tree_total_tokens: int
    dynamic_speculation: bool
    max_speculation_depth: int
    collapse_fallback: bool
    verify_chunk_depth: int | None
    verify_mode: str
    cpu_backend: bool
    compile_verify: bool
    draft_mode: str
    sampling_shape: TunedShape | None = None  # tuned for do_sample=True with one prompt
    batch_shapes: dict[int, TunedShape] = field(default_factory=dict)  # tuned per batch size

    @classmethod
    def of(cls, config) -> SpeculationSettings:
        """The settings a generation config holds (defaults where unset), each checked; one set by its old name moves
        to its new name (`RENAMED_SETTINGS`)."""
        _move_renamed(config)
        shapes = getattr(config, "batch_shapes", None) or {}
        return cls(**{name: _checked(config, name) for name in SPECULATION_DEFAULTS},
                   sampling_shape=TunedShape.parse(getattr(config, "sampling_shape", None), "sampling_shape"),
                   batch_shapes={int(size): TunedShape.parse(shape, "batch_shapes") for size, shape in shapes.items()})

    def tuned_shape(self, batch_size: int, do_sample: bool) -> TunedShape | None:
        """The shape tuning chose for this kind of call: for the largest tuned batch size up to `batch_size`, or for
        sampling one row; None: the drafter's own chain or tree settings."""
        if batch_size == 1:
            return self.sampling_shape if do_sample else None
        fitting = [size for size in self.batch_shapes if size <= batch_size]
        return self.batch_shapes[max(fitting)] if fitting else None


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Low, middle and high features: the inputs of layers 2, L//2 and L-3 (EAGLE-3's choice)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def safeailab_tree_settings(total_token: int | None = None, depth: int | None = None,
                            top_k: int | None = None) -> dict[str, int]:
    """SafeAILab's `EaModel` tree settings in this project's names, with SafeAILab's meaning kept.

    SafeAILab/EAGLE eagle/model/cnets.py (`Model.__init__`, `topK_genrate`): `total_token` counts the
    root it verifies with the draft (`self.total_tokens = total_token - 1` draft tokens), and `depth`
    counts the levels after the first (one top-k expansion, then `depth` more). Ours count draft tokens
    and all levels, so its `total_token=60, depth=7, top_k=10` is our `tree_total_tokens=59,
    tree_depth=8, tree_top_k=10`. Copying the numbers across unchanged gives a different tree.
    """
    if total_token is not None and total_token < 2:
        raise ValueError(f"total_token={total_token}: SafeAILab's -1 (time candidate sizes) has no counterpart "
                         "here; use hf_eagle31.tuning.tune_drafter, or give a size of at least 2 (the root and one draft)")
    if depth is not None and depth < 0:
        raise ValueError(f"depth={depth} cannot be negative")
    settings = {"tree_total_tokens": None if total_token is None else total_token - 1,
                "tree_depth": None if depth is None else depth + 1, "tree_top_k": top_k}
    return {name: value for name, value in settings.items() if value is not None}


class Eagle3Config(PreTrainedConfig):
    r"""
    Configuration of an EAGLE-3 or EAGLE 3.1 drafter.

    `vocab_size` and `target_hidden_size` describe the *target* model the drafter serves;
    `hidden_size` and the attention/MLP sizes describe the drafter's decoder layer: EAGLE-3's single one, or
    with `num_hidden_layers` > 1 that one followed by plain pre-norm layers of the same shape.
    `target_layer_ids` index the target's `hidden_states` (0 is the embedding output), so
    `[2, L//2, L-3]` are the inputs of those decoder layers.

    The two EAGLE 3.1 switches, both off for an EAGLE-3 head:
      * `fc_norm`: one RMSNorm per captured target state before `fc`, so no layer's scale dominates.
      * `norm_output`: feed the post-`norm` state (what the LM head sees) back into the next draft step.

    Variants that vLLM serves: `norm_before_residual` (speculators) makes the residual stream start
    from the normed feature; `norm_before_fc` (gpt-oss heads) puts one RMSNorm over the whole
    concatenation before `fc` (not the same as `fc_norm`, and exclusive with it). A head may capture
    more than three target layers: `fc` reads `len(target_layer_ids)` of them.
    `include_embedding` says whether the checkpoint carries its own copy of the target's input
    embedding; the drafter uses the target's embedding whenever it is attached to one.
    `verifier_name_or_path` is the target the checkpoint says it was trained for (speculators'
    `verifier.name_or_path`), so that an export to speculators can name it.
    """

    model_type = MODEL_TYPE

    vocab_size: int = 32000
    draft_vocab_size: int | None = None
    hidden_size: int = 4096
    target_hidden_size: int | None = None
    intermediate_size: int = 14336
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    include_embedding: bool = False
    verifier_name_or_path: str | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_drafter()

    def validate_drafter(self) -> None:
        """Reject configurations that would only fail later, deep inside a matmul."""
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed the target vocabulary "
                f"vocab_size ({self.vocab_size})."
            )
        if isinstance(self.num_hidden_layers, bool) or not isinstance(self.num_hidden_layers, int) or \
                self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be a whole number >= 1, got {self.num_hidden_layers!r}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        theta = (self.rope_parameters or {}).get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float, type(None))):
            raise ValueError(f"rope_theta must be a number, got {theta!r}.")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm (one RMSNorm per captured layer) and norm_before_fc (one RMSNorm over their "
                             "concatenation) exclude each other.")
        ids = self.target_layer_ids
        if ids is not None:
            if len(ids) < 3:
                raise ValueError(f"target_layer_ids must list at least 3 target layers (low, mid, high), got {ids}.")
            top = self.num_target_layers
            if min(ids) < 0 or (top is not None and max(ids) > top):
                raise ValueError(
                    f"target_layer_ids {ids} out of range for a target with {top} decoder layers "
                    f"(valid hidden_states indices are 0..{top})."
                )

    @property
    def num_aux_hidden_states(self) -> int:
        """How many target layers `fc` reads (vLLM's and SGLang's name): the listed ones, else EAGLE-3's three."""
        return len(self.target_layer_ids) if self.target_layer_ids else 3


__all__ = ["Eagle3Config", "default_target_layer_ids", "safeailab_tree_settings", "MODEL_TYPE",
           "SPECULATION_DEFAULTS"]
