"""The drafter's configuration: one Llama-style decoder layer plus the EAGLE-3 / 3.1 specifics."""

from __future__ import annotations

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
    # how a verify forward is computed (see verification.VerifyPlan): "batched" (one SDPA call with
    # the tree mask), "kernel" (the Triton tree-attention kernel on CUDA) or "exact" (bit-identical
    # to one-token decoding on any device, at a higher verify cost)
    "verify_mode": "batched",
}


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Low, middle and high features: the inputs of layers 2, L//2 and L-3 (EAGLE-3's choice)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


class Eagle3Config(PreTrainedConfig):
    r"""
    Configuration of an EAGLE-3 or EAGLE 3.1 drafter.

    `vocab_size` and `target_hidden_size` describe the *target* model the drafter serves;
    `hidden_size` and the attention/MLP sizes describe the drafter's single decoder layer.
    `target_layer_ids` index the target's `hidden_states` (0 is the embedding output), so
    `[2, L//2, L-3]` are the inputs of those decoder layers.

    The two EAGLE 3.1 switches, both off for an EAGLE-3 head:
      * `fc_norm`: one RMSNorm per captured target state before `fc`, so no layer's scale dominates.
      * `norm_output`: feed the post-`norm` state (what the LM head sees) back into the next draft step.

    `norm_before_residual` (a speculators option) makes the residual stream start from the normed feature.
    `include_embedding` says whether the checkpoint carries its own copy of the target's input
    embedding; the drafter uses the target's embedding whenever it is attached to one.
    """

    model_type = MODEL_TYPE

    vocab_size: int = 32000
    draft_vocab_size: int | None = None
    hidden_size: int = 4096
    target_hidden_size: int | None = None
    intermediate_size: int = 14336
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
    include_embedding: bool = False
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
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        ids = self.target_layer_ids
        if ids is not None:
            if len(ids) != 3:
                raise ValueError(f"target_layer_ids must list 3 target layers (low, mid, high), got {ids}.")
            top = self.num_target_layers
            if min(ids) < 0 or (top is not None and max(ids) > top):
                raise ValueError(
                    f"target_layer_ids {ids} out of range for a target with {top} decoder layers "
                    f"(valid hidden_states indices are 0..{top})."
                )


__all__ = ["Eagle3Config", "default_target_layer_ids", "MODEL_TYPE", "SPECULATION_DEFAULTS"]
