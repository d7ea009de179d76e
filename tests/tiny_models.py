"""Small randomly initialised targets and matching drafters, built offline for the tests.

Every target is a stock transformers model (Llama, Qwen2, Mistral) with a few layers, so tests
exercise the real modeling code that users run. `initializer_range` is larger than the usual 0.02
so that greedy choices are decided by clear margins rather than by float noise.
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_eagle31 import Eagle3Config, Eagle3DraftModel

VOCAB = 256
HIDDEN = 64
LAYERS = 6
HEAD_SCALE = 6.0

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def make_target(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A randomly initialised stock transformers causal LM with the shared tiny shape.

    The output head is scaled up so the next-token distributions are peaked like a trained
    model's (a random tiny model is otherwise nearly uniform and its argmax is float noise).
    """
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed + 1000 * list(ARCHITECTURES).index(arch))
    model = model_cls(config_cls(**_COMMON, **extra))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model.to(dtype).eval()


def drafter_config(target: PreTrainedModel, eagle31: bool = True, **overrides) -> Eagle3Config:
    """A drafter config matching `target`; `eagle31` turns both 3.1 switches on."""
    tc = target.config
    fields = dict(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        num_target_layers=tc.num_hidden_layers,
        max_position_embeddings=tc.max_position_embeddings,
        initializer_range=0.1,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    fields.update(overrides)
    return Eagle3Config(**fields)


def make_drafter(target: PreTrainedModel, eagle31: bool = True, seed: int = 1, **overrides) -> Eagle3DraftModel:
    """A random drafter for `target`, in the target's dtype, sharing its embedding."""
    torch.manual_seed(seed)
    drafter = Eagle3DraftModel(drafter_config(target, eagle31, **overrides)).to(target.dtype).eval()
    drafter.set_target_embedding(target.get_input_embeddings())
    return drafter
