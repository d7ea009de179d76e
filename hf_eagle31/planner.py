"""Memory planner: does target + drafter + KV cache + tree buffers fit on a GPU at context C?

Answered from the target's config alone, before anything is loaded (`hf-eagle31 plan`). The target
is built on the meta device, so every parameter shape comes from transformers' own modeling code,
and the layers bitsandbytes would quantize are chosen by transformers' own rule: every plain
`nn.Linear` (or GPT-2 `Conv1D`) except the output embedding, tied weights and `_keep_in_fp32_modules`.
Embeddings, norms, biases and `lm_head` stay in 16-bit.

bitsandbytes storage per quantized weight of n elements and `out` rows (bitsandbytes 0.50, blocksize 64):
  * int8 (LLM.int8): n int8 bytes + one fp32 scale per row (`SCB`).
  * nf4 / fp4: n/2 bytes (two codes a byte) + one fp32 absmax per block of 64 + its 16-entry fp32 code.
  * double quant ("-dq"): the absmax are quantized again, to uint8, with one fp32 absmax per block of 256
    and a 256-entry fp32 code, plus one fp32 offset.

The workspace component is an estimate: 512 MiB for the CUDA context and cuBLAS workspace, plus the
activation peak of the largest single forward (one decoder layer's intermediates; attention through
memory-efficient SDPA, so no C x C scores), and for a quantized target one dequantized copy of its
largest quantized weight.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

GiB = 1 << 30
MiB = 1 << 20
CUDA_CONTEXT = 512 * MiB  # an estimate: CUDA context + cuBLAS workspace, 300-600 MiB on recent drivers
DRAFT_VOCAB = 32000  # the EAGLE-3 reference drafters' draft vocabulary
BNB_BLOCKSIZE = 64
BNB_NESTED_BLOCKSIZE = 256

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZATIONS = ("bf16", "fp16", "fp32", "int8", "nf4", "fp4", "nf4-dq", "fp4-dq")

# memory.total as nvidia-smi reports it
GPUS: dict[str, tuple[str, int]] = {
    "rtx3090": ("RTX 3090 24 GB", 24576 * MiB),
    "rtx4090": ("RTX 4090 24 GB", 24564 * MiB),
    "l4": ("L4 24 GB", 23034 * MiB),
    "a6000": ("RTX A6000 48 GB", 49140 * MiB),
    "a100": ("A100 80 GB", 81920 * MiB),
    "h100": ("H100 80 GB", 81559 * MiB),
}

_UNITS = {"": GiB, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40}


def parse_memory(text: str) -> int:
    """'24GiB', '24 GB' (decimal), '23034MiB'; a bare number is GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read GPU memory {text!r}: write e.g. 24GiB, 24GB or 23034MiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"GPU memory {text!r} is no memory at all: give the card's size, e.g. 24GiB")
    return size


def gpu_memory(gpu: str) -> tuple[str, int]:
    """A preset card's name and memory."""
    key = gpu.lower().replace(" ", "").replace("-", "")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(GPUS)} or pass --gpu-mem")
    return GPUS[key]


def load_config(target: str | Path | PretrainedConfig) -> PretrainedConfig:
    """A config.json path, a model folder, a Hub id, a packaged model's name, or a config object."""
    from hf_eagle31.packaged import resolve_model

    if isinstance(target, PretrainedConfig):
        return target
    try:
        return AutoConfig.from_pretrained(resolve_model(str(target)))
    except OSError as err:
        raise FileNotFoundError(f"cannot read a model config from {target!r}: {err}") from None


def kv_windows(text: PretrainedConfig) -> list[int | None]:
    """Each decoder layer's attention window, None for full attention.

    A windowed layer's cache keeps only its last `window` tokens (transformers' sliding-window
    cache layer), and EAGLE verifies such layers at any context, so its KV does not grow with it.
    Layers are windowed as transformers' cache sees them: by `layer_types`, or all of them when the
    config has a `sliding_window` and no layer types (Mistral).
    """
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None) or [
        "sliding_attention" if window else "full_attention"] * text.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The target with every parameter on the meta device: exact shapes, no memory."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise ValueError(f"transformers cannot build a causal LM from this config: {err}") from None


def quantized_linears(model: PreTrainedModel) -> dict[str, nn.Module]:
    """The modules bitsandbytes replaces, by transformers' rule (see `replace_with_bnb_linear`)."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = [*get_keys_to_not_convert(model), *(getattr(model, "_keep_in_fp32_modules", None) or [])]
    return {
        name: module
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, skip)
    }


def bnb_weight_bytes(numel: int, rows: int, quant: str) -> int:
    """Bytes bitsandbytes stores for one quantized weight (module docstring has the layout)."""
    if quant == "int8":
        return numel + 4 * rows
    blocks = math.ceil(numel / BNB_BLOCKSIZE)
    packed = math.ceil(numel / 2) + 16 * 4  # 4-bit codes + the 16-entry code book
    if not quant.endswith("-dq"):
        return packed + 4 * blocks
    return packed + blocks + 4 * math.ceil(blocks / BNB_NESTED_BLOCKSIZE) + 256 * 4 + 4


def target_weight_bytes(model: PreTrainedModel, quant: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Parameters (shared ones once) and buffers of a meta-device target, quantized as bitsandbytes would."""
    if quant not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quant!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if quant in DTYPES:
        dtype, quantized = DTYPES[quant], {}
    else:
        quantized = quantized_linears(model)
    size = dtype.itemsize
    total = sum(b.numel() * b.element_size() for b in model.buffers())
    for name, param in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if kind == "weight" and module_name in quantized:
            total += bnb_weight_bytes(param.numel(), quantized_rows(quantized[module_name]), quant)
        else:
            total += param.numel() * size
    return total


def quantized_rows(module: nn.Module) -> int:
    """Output rows of a Linear (or the transposed GPT-2 Conv1D)."""
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]


def drafter_for(model: PreTrainedModel, dtype: torch.dtype, draft_vocab_size: int | None, eagle31: bool) -> nn.Module:
    """The default drafter for this target, on the meta device (embedding shared, so not built)."""
    from hf_eagle31.modeling import Eagle3DraftModel
    from hf_eagle31.training.trainer import drafter_config_for

    config = drafter_config_for(model, "eagle3.1" if eagle31 else "eagle3", draft_vocab_size)
    with torch.device("meta"):
        return Eagle3DraftModel(config).to(dtype)


def tensor_bytes(module: nn.Module, exclude: set[int] = frozenset()) -> int:
    """Bytes of a live module's parameters, buffers and bitsandbytes quantization state, each storage once.

    Tensors whose data pointer is in `exclude` (memory owned by another model) are not counted.
    """
    seen = set(exclude)
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        for t in (tensor, *_quantization_tensors(tensor)):
            key = id(t) if t.is_meta else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _quantization_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside a quantized weight: 4-bit QuantState, or the int8 row scales."""
    state = getattr(param, "quant_state", None)
    found = [getattr(param, "SCB", None)]
    while state is not None:  # QuantState, then its nested state for double quant
        found += [state.absmax, state.code, getattr(state, "offset", None)]
        state = getattr(state, "state2", None)
    return [t for t in found if isinstance(t, torch.Tensor)]


def drafter_memory_report(drafter: nn.Module, target: nn.Module) -> dict:
    """A live drafter's own memory next to its target's: what speculation costs on top of the target.

    Storage the drafter shares with the target (its input embedding) is counted once, under the target.
    """
    target_ptrs = {t.data_ptr() for t in (*target.parameters(), *target.buffers())}
    embedding = drafter.get_input_embeddings()
    target_bytes = tensor_bytes(target)
    drafter_bytes = tensor_bytes(drafter, exclude=target_ptrs)
    return {
        "drafter_bytes": drafter_bytes,
        "target_bytes": target_bytes,
        "shared_bytes": tensor_bytes(drafter) - drafter_bytes,
        "embedding_shared": embedding is not None and embedding.weight.data_ptr() in target_ptrs,
        "percent": 100.0 * drafter_bytes / target_bytes,
    }


@dataclass
class MemoryPlan:
    """Bytes per component at one context length, and what to do when they do not fit."""

    quant: str
    context: int
    tree_tokens: int
    components: dict[str, int]
    gpu_name: str | None = None
    gpu_bytes: int | None = None
    longest_context: int | None = None  # with this quantization and tree, None if nothing fits
    max_position_embeddings: int | None = None
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_bytes is None else self.total <= self.gpu_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}


class Planner:
    """Context-independent facts about a target (and its default drafter), then plans per quantization.

    The drafter is `drafter_config_for`'s: one decoder layer shaped like the target's, with a draft
    vocabulary of `draft_vocab_size` (default 32000, or the target's vocabulary if smaller).
    """

    def __init__(self, target: str | Path | PretrainedConfig, dtype: str = "bf16",
                 draft_vocab_size: int | None = None, eagle31: bool = True):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        self.config = load_config(target)
        self.text = self.config.get_text_config()
        self.dtype, self.dtype_name = DTYPES[dtype], dtype
        self.model = meta_model(self.config)
        self._weights: dict[str, int] = {}
        if draft_vocab_size is None:
            draft_vocab_size = min(DRAFT_VOCAB, self.text.vocab_size)
        self.drafter = drafter_for(self.model, self.dtype, draft_vocab_size, eagle31)
        self.drafter_bytes = tensor_bytes(self.drafter)
        t = self.text
        self.head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        self.kv_heads = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
        self.windows = kv_windows(t)

    def weights(self, quant: str) -> int:
        if quant not in self._weights:
            self._weights[quant] = target_weight_bytes(self.model, quant, self.dtype)
        return self._weights[quant]

    @functools.cached_property
    def largest_quantized_weight(self) -> int:
        return max(m.weight.numel() for m in quantized_linears(self.model).values())

    def kv_cache(self, layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
        """K and V for every layer and token (batch 1)."""
        return layers * 2 * kv_heads * head_dim * tokens * self.dtype.itemsize

    def target_kv_cache(self, context: int) -> int:
        """The target's KV cache at `context` tokens: full layers hold them all, windowed ones their window."""
        return sum(self.kv_cache(1, self.kv_heads, self.head_dim, min(context, window or context))
                   for window in self.windows)

    def target_kv_label(self, context: int) -> str:
        windows = sorted({window for window in self.windows if window})
        if not windows:
            return f"target KV cache ({context} tokens)"
        count = sum(window is not None for window in self.windows)
        return (f"target KV cache ({context} tokens; {count} of {len(self.windows)} layers windowed at "
                f"{', '.join(map(str, windows))})")

    def tree_buffers(self, context: int, tree_tokens: int) -> int:
        """One verify forward of the tree: fp32 logits, the 3 captured states, its KV rows, its mask."""
        t, n = self.text, tree_tokens
        logits = n * t.vocab_size * 4
        features = 3 * n * t.hidden_size * self.dtype.itemsize
        kv_rows = self.kv_cache(t.num_hidden_layers, self.kv_heads, self.head_dim, n)
        mask = n * (context + n)  # bool, over the cached context and the tree
        return logits + features + kv_rows + mask

    def activation_peak(self, quant: str, context: int, tree_tokens: int) -> int:
        """The largest single forward: target prefill, drafter catch-up over the prompt, or tree verify."""
        t, d, size = self.text, self.drafter.config, self.dtype.itemsize
        q, kv = t.num_attention_heads * self.head_dim, self.kv_heads * self.head_dim
        layer = 2 * t.hidden_size + 2 * q + 2 * kv + 3 * t.intermediate_size  # residual, norm, q/k/v/o, mlp
        captured = 3 * t.hidden_size
        prefill = context * (layer + captured) * size
        d_q, d_kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
        d_layer = 2 * captured + 4 * d.hidden_size + 2 * d_q + 2 * d_kv + 3 * d.intermediate_size
        # catch-up: queued + concatenated features per position; logits at the last position only
        drafter = context * d_layer * size + d.draft_vocab_size * size
        expanded_kv = 2 * t.num_attention_heads * (context + tree_tokens) * self.head_dim * size  # GQA repeat
        verify = tree_tokens * layer * size + expanded_kv
        peak = max(prefill, drafter, verify)
        if quant not in DTYPES:  # bitsandbytes dequantizes a whole weight for multi-token matmuls
            peak += self.largest_quantized_weight * size
        return peak

    def components(self, quant: str, context: int, tree_tokens: int) -> dict[str, int]:
        d = self.drafter.config
        return {
            f"target weights ({quant})": self.weights(quant),
            f"drafter weights ({self.dtype_name})": self.drafter_bytes,
            self.target_kv_label(context): self.target_kv_cache(context),
            f"drafter KV cache ({context + tree_tokens} tokens)": self.kv_cache(
                d.num_hidden_layers, d.num_key_value_heads, d.head_dim, context + tree_tokens),
            f"tree buffers ({tree_tokens} tokens)": self.tree_buffers(context, tree_tokens),
            "workspace (estimate)": CUDA_CONTEXT + self.activation_peak(quant, context, tree_tokens),
        }

    def total(self, quant: str, context: int, tree_tokens: int) -> int:
        return sum(self.components(quant, context, tree_tokens).values())

    def longest_context(self, quant: str, tree_tokens: int, gpu_bytes: int) -> int | None:
        """The longest context (up to the model's maximum) that fits; the total grows with context."""
        low, high = 0, self.text.max_position_embeddings
        while low < high:
            mid = (low + high + 1) // 2
            if self.total(quant, mid, tree_tokens) <= gpu_bytes:
                low = mid
            else:
                high = mid - 1
        return low or None

    def plan(self, quant: str, context: int, tree_tokens: int, gpu_bytes: int | None = None,
             gpu_name: str | None = None) -> MemoryPlan:
        if context < 1 or tree_tokens < 1:
            raise ValueError(f"context and tree tokens must be positive, got {context} and {tree_tokens}")
        plan = MemoryPlan(quant, context, tree_tokens, self.components(quant, context, tree_tokens), gpu_name,
                          gpu_bytes, max_position_embeddings=self.text.max_position_embeddings)
        if gpu_bytes is not None:
            plan.longest_context = self.longest_context(quant, tree_tokens, gpu_bytes)
            plan.advice = self.advice(plan)
        return plan

    def advice(self, plan: MemoryPlan) -> list[str]:
        """What fits instead: a shorter context, a smaller quantization, a bigger card."""
        longest, gib = plan.longest_context, lambda b: f"{b / GiB:.2f} GiB"
        if plan.fits:
            lines = [f"fits with {gib(plan.gpu_bytes - plan.total)} to spare."]
            if longest is not None and longest > plan.context:
                lines.append(f"the longest context that fits is {longest} tokens"
                             + (" (the model's maximum)." if longest == plan.max_position_embeddings else "."))
            return lines
        lines = [f"does not fit: needs {gib(plan.total)}, the card has {gib(plan.gpu_bytes)} "
                 f"(short by {gib(plan.total - plan.gpu_bytes)})."]
        if longest is not None:
            lines.append(f"a context of at most {longest} tokens fits with {plan.quant}.")
        else:
            weights = gib(self.weights(plan.quant))
            lines.append(f"the {plan.quant} weights alone ({weights}) leave no memory for any context.")
        smaller = [q for q in sorted(QUANTIZATIONS, key=self.weights, reverse=True)  # least lossy first
                   if self.weights(q) <= self.weights(plan.quant)]
        fitting = [q for q in smaller[1:] if self.total(q, plan.context, plan.tree_tokens) <= plan.gpu_bytes]
        smallest = min(QUANTIZATIONS, key=self.weights)
        if fitting:
            lines.append(f"--quant {fitting[0]} fits at {plan.context} tokens on this card.")
        elif smallest != plan.quant and (shorter := self.longest_context(smallest, plan.tree_tokens, plan.gpu_bytes)):
            lines.append(f"--quant {smallest} fits a context of at most {shorter} tokens on this card.")
        bigger = sorted((card for card in GPUS.values() if card[1] > plan.gpu_bytes), key=lambda card: card[1])

        def smallest_card(quants: list[str]) -> tuple[str, int, str] | None:
            for name, memory in bigger:
                for quant in quants:
                    if self.total(quant, plan.context, plan.tree_tokens) <= memory:
                        return name, memory, quant
            return None

        same = smallest_card([plan.quant])
        lower = None if fitting else smallest_card(smaller[1:])
        if same:
            lines.append(f"the {same[0]} fits it at {plan.context} tokens with {plan.quant}.")
        if lower and (same is None or lower[1] < same[1]):
            lines.append(f"the {lower[0]} fits it at {plan.context} tokens with --quant {lower[2]}.")
        if not (same or lower or fitting):
            lines.append(f"no bigger card listed here fits it at {plan.context} tokens: split it over several GPUs.")
        return lines
