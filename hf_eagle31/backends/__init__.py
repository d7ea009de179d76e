"""Device acceleration behind one door: how a call's verify forwards and the drafter's products are computed.

    prepared = prepare(backend_for(target, cpu_backend), target, drafter, compile_verify)
    prepared.forward(**inputs)                                  # any other target forward of the call (the prefill)
    prepared.verify(cache, plan, tokens, positions, compiled)   # raw logits [B, n, V], features [B, n, 3 H_t]
    prepared.draft_products                                     # the drafter forward's `products`, or None
    prepared.draft_forward                                      # the drafter's forward computed whole, or None
    prepared.draft_replay                                       # a fixed-shape draft's replay (CUDA graphs), or None
    prepared.compiled                                           # whether the verify forwards run as one inductor graph
    prepared.argmax                                             # a greedy pick of scores [..., V] -> [..., 1], or None
    prepared.truncate(cache, length)                            # drop the cache's entries past `length`

The default backend runs transformers' forward unchanged (`verification.verify_forward`) and the drafter's
layers as modules. The CPU backend (cpu/) computes the same products faster on a CPU and, for a
Llama-family target, skips transformers' module dispatch. A backend only reads the models: whatever
happens during a call, they are afterwards what they were before (weights, hooks, forwards), and other
threads' calls on them never see a backend's work. The decoding loop and tuning take what `prepare`
gives; nothing below them imports this package (the import contract in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from transformers import Cache, PreTrainedModel

from hf_eagle31.cache import truncate_cache
from hf_eagle31.drafting import DraftForward, Replay
from hf_eagle31.modeling import Eagle3DraftModel, Products
from hf_eagle31.verification import verify_forward
from hf_eagle31.verify_plan import VerifyPlan

# one verify forward: (cache, plan, tokens [B, n], positions [B, n], transformers' compiled call or None)
# -> (raw float logits [B, n, V], the drafter's features [B, n, 3 H_t])
Verify = Callable[[Cache, VerifyPlan, torch.Tensor, torch.Tensor, Callable | None], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TargetForwards:
    """How one call runs the target: its forward for anything but a verify block (the prefill: `forward(**inputs)`)
    and its verify forward; `compiled`: whether the verify forwards run as one inductor graph (`compile_verify`);
    `argmax`: how a greedy decoding picks from its processed scores, `scores.argmax(-1, keepdim=True)`'s result
    computed faster (None: torch's own); `truncate`: how the cache a verify forward grew drops the entries the walk
    rejected (`cache.truncate_cache`, or the backend's own for the cache it holds)."""

    forward: Callable[..., object]
    verify: Verify
    compiled: bool = False
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    truncate: Callable[[Cache, int], None] = truncate_cache


@dataclass(frozen=True)
class Prepared(TargetForwards):
    """What one call runs the target's forwards and the drafter's products on."""

    draft_products: Products | None = None
    draft_forward: DraftForward | None = None
    draft_replay: Replay | None = None


class Backend(Protocol):
    name: str

    def target_forwards(self, target: PreTrainedModel, target_layer_ids: list[int],
                        compile_verify: bool = False) -> TargetForwards:
        """The target's forwards for one call, its verify forward capturing the features at `target_layer_ids`."""

    def products(self, model: torch.nn.Module) -> Products | None:
        """Products for the model's linear layers (`modeling.linear_outputs`), None: its layers' own calls."""

    def draft_forward(self, drafter: Eagle3DraftModel, products: Products | None) -> DraftForward | None:
        """The drafter's forward for one call computed whole on `products` (this backend's), None: its modules'."""

    def draft_replay(self, drafter: Eagle3DraftModel) -> Replay | None:
        """How one call replays the drafter's fixed-shape drafts (`draft_mode="static"`), None: drafted eagerly."""


def prepare(backend: Backend, target: PreTrainedModel, drafter: Eagle3DraftModel | None,
            compile_verify: bool = False) -> Prepared:
    """What one call runs on; without a drafter (`fast_decoding`) no features are captured."""
    layer_ids = drafter.config.target_layer_ids if drafter is not None else []
    forwards = vars(backend.target_forwards(target, layer_ids, compile_verify))
    if drafter is None:
        return Prepared(**forwards)
    products = backend.products(drafter)
    return Prepared(**forwards, draft_products=products, draft_forward=backend.draft_forward(drafter, products),
                    draft_replay=backend.draft_replay(drafter))


class DefaultBackend:
    """transformers' forward unchanged, the drafter's layers called as modules: any device, any target."""

    name = "default"

    def target_forwards(self, target: PreTrainedModel, target_layer_ids: list[int],
                        compile_verify: bool = False) -> TargetForwards:
        def verify(cache, plan, tokens, positions, compiled=None):
            return verify_forward(target, cache, plan, tokens, positions, target_layer_ids, compiled)

        return TargetForwards(target, verify)

    def products(self, model: torch.nn.Module) -> None:
        return None

    def draft_forward(self, drafter: Eagle3DraftModel, products: Products | None) -> None:
        return None

    def draft_replay(self, drafter: Eagle3DraftModel) -> Replay | None:
        """CUDA graphs on CUDA (backends/graphs.py)."""
        if drafter.device.type != "cuda":
            return None
        from hf_eagle31.backends.graphs import GraphReplay

        return GraphReplay()


DEFAULT = DefaultBackend()


def torch_as_usual(device: torch.device) -> bool:
    """Whether torch computes as it does by default in this thread: no autocast on `device`, and no torch function
    or dispatch mode on the stacks but torch's device context.

    Why: the CPU backend computes the products itself, so a user's autocast (which would run them in another
    dtype) or mode (which would change or see `F.linear`) would not apply to them. Such a call runs on the default
    backend, where every operation goes through torch as plain `generate`'s do."""
    if torch.is_autocast_enabled(device.type) or _get_current_dispatch_mode_stack():
        return False
    return all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


def backend_for(target: PreTrainedModel, cpu_backend: bool) -> Backend:
    """The backend a call with `cpu_backend` (the drafter's setting) runs on: the CPU backend where it serves the
    target and torch computes as usual (`torch_as_usual`), else the default one."""
    if cpu_backend:
        from hf_eagle31.backends.cpu import CPU  # imported on first use: a CUDA call never loads the CPU machinery

        if CPU.serves(target) and torch_as_usual(target.device):
            return CPU
    return DEFAULT


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix multiplications run at full speed on `device`: CUDA, or a CPU where oneDNN computes bf16 (AVX-512)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
