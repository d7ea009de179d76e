"""Small randomly initialised targets and matching drafters, built offline for the tests.

Every target is a stock transformers model (Llama, Qwen2, Mistral) with a few layers, so tests
exercise the real modeling code that users run. `initializer_range` is larger than the usual 0.02
so that greedy choices are decided by clear margins rather than by float noise.
"""

from __future__ import annotations

import functools

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
from hf_eagle31.configuration import SPECULATION_DEFAULTS
from hf_eagle31.training import drafter_config_for
from transformers import GenerationConfig

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
    return drafter_config_for(target, "eagle3.1" if eagle31 else "eagle3", initializer_range=0.1, **overrides)


def make_drafter(target: PreTrainedModel, eagle31: bool = True, seed: int = 1, **overrides) -> Eagle3DraftModel:
    """A random drafter for `target`, in the target's dtype, sharing its embedding."""
    torch.manual_seed(seed)
    drafter = Eagle3DraftModel(drafter_config(target, eagle31, **overrides)).to(target.dtype).eval()
    drafter.set_target_embedding(target.get_input_embeddings())
    return drafter


def distill(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: torch.Tensor, new_tokens: int = 64,
            steps: int = 300) -> Eagle3DraftModel:
    """Fit `drafter` to the target's greedy continuations of `prompts` (a few seconds on CPU).

    A deliberately small stand-in for the training pipeline: one draft step, teacher-forced, soft
    targets from the target's logits. A random tiny target does not generalise, so the drafter
    mostly memorises these continuations: generating from the same prompts gives tests real,
    partial acceptance (long accepted paths and rejections), which is what they need to exercise.
    """
    from hf_eagle31.features import capture_request, select_features

    with torch.no_grad():
        sequences = target.generate(prompts, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out = target(sequences, output_hidden_states=capture_request(drafter.config.target_layer_ids))
        features = select_features(out.hidden_states, drafter.config.target_layer_ids).float()
        soft_targets = torch.softmax(out.logits[:, 1:].float(), dim=-1)
    dtype = drafter.dtype
    drafter.float().train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = drafter(sequences[:, 1:], features[:, :-1]).logits
        loss = -(soft_targets * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.to(dtype).eval()


def make_tokenizer():
    """A tokenizer over the tiny vocabulary: ids 3..28 are the letters a..z, the rest two-letter merges,
    decoded by plain concatenation, so stop strings can span token boundaries."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    letters = [chr(97 + i) for i in range(26)]
    pairs = [a + b for a in letters for b in letters][: VOCAB - 3 - len(letters)]
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *letters, *pairs])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(p[0], p[1]) for p in pairs], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# Prompts the trained pairs have memorised continuations for (see `distill`).
PROMPTS = torch.randint(3, VOCAB, (6, 6), generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=None)
def _trained_pair(arch: str, eagle31: bool) -> tuple[PreTrainedModel, Eagle3DraftModel]:
    target = make_target(arch)
    return target, distill(target, make_drafter(target, eagle31), PROMPTS)


def trained_pair(arch: str = "llama", eagle31: bool = True, **speculation) -> tuple[PreTrainedModel, Eagle3DraftModel]:
    """A target and a drafter fitted to it (cached), with fresh speculation settings."""
    target, drafter = _trained_pair(arch, eagle31)
    drafter.generation_config = GenerationConfig(**{**SPECULATION_DEFAULTS, **speculation})
    return target, drafter


def verify_logits(target, cache, tokens, positions, mask, layer_ids, mode="batched"):
    """The raw logits `[n, V]` of one verify forward over a single row's block (the target in `eagle_verification`)."""
    from hf_eagle31.verification import verify_forward
    from hf_eagle31.verify_plan import VerifyPlan

    plan = VerifyPlan.for_cache(mask[None], cache, mode)
    return verify_forward(target, cache, plan, tokens[None], positions[None], layer_ids)[0][0]
