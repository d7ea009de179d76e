"""Capture the target's hidden states at `target_layer_ids` without materialising every layer.

transformers 5.17+ accepts a list of indices as `output_hidden_states` and records only those.
What the indices mean changed in 5.23: before, index `i` selected the output of decoder layer `i`
(a tuple of `L` entries); from 5.23 it selects `hidden_states[i]` (a tuple of `L + 1` entries,
index 0 being the embedding output). EAGLE's `target_layer_ids` always mean `hidden_states[i]`,
the input of decoder layer `i`, so the two helpers below translate for the installed version.
"""

from __future__ import annotations

import torch
from transformers.utils import output_capturing

INDEXES_HIDDEN_STATES = hasattr(output_capturing, "selected_hidden_states")


def capture_request(target_layer_ids: list[int]) -> list[int] | bool:
    """The `output_hidden_states` value that records `hidden_states[i]` for each `i` in `target_layer_ids` (False for
    none: decoding without a drafter)."""
    if not target_layer_ids:
        return False
    if INDEXES_HIDDEN_STATES:
        return list(target_layer_ids)
    if min(target_layer_ids) < 1:
        raise ValueError(
            "transformers < 5.23 cannot capture the embedding output (target_layer_ids contains 0); "
            "upgrade transformers or use layer ids >= 1."
        )
    return [i - 1 for i in target_layer_ids]


def select_features(hidden_states: tuple[torch.Tensor | None, ...] | None,
                    target_layer_ids: list[int]) -> torch.Tensor | None:
    """Concatenate the captured states (low, mid, high) into the drafter's `3 * H_t` input (None for no layers)."""
    if not target_layer_ids:
        return None
    return torch.cat([hidden_states[i] for i in capture_request(target_layer_ids)], dim=-1)


_INSTALLED = "_output_capturing_hooks_installed"  # transformers marks a (sub)model whose hooks it installed


def capturing_hooked(model: torch.nn.Module) -> set[int]:
    """The ids of the (sub)models of `model` on which transformers has installed its output-capturing hooks."""
    return {id(module) for module in model.modules() if vars(module).get(_INSTALLED, False)}


def remove_capturing_hooks(model: torch.nn.Module, keep: set[int]) -> None:
    """Remove the output-capturing hooks transformers installed below `model` since `capturing_hooked` gave `keep`.

    Why: transformers installs them for good at the first forward that asks for hidden states, and the prefill of
    an EAGLE call asks for the drafter's features: a call would otherwise leave hooks on a model that had none.
    Unmarked first, so that a forward starting meanwhile installs them again for itself."""
    added = [module for module in model.modules() if vars(module).get(_INSTALLED, False) and id(module) not in keep]
    for hooked in added:
        delattr(hooked, _INSTALLED)
        for module in hooked.modules():
            for handle_id, hook in list(module._forward_hooks.items()):
                if getattr(hook, "__module__", None) == output_capturing.__name__:
                    del module._forward_hooks[handle_id]
