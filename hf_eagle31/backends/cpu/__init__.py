"""The CPU backend: the models' products held beside them (products.py: each row count on the implementation
measured fastest for it on the machine, routes.py: the rows kernel over the weights as they are, torch's product, or
oneDNN's reordered copies), and for a Llama, Mistral or Qwen2 target a verify forward without transformers' module
dispatch (lean.py), eager or compiled (`compile_verify`, fast_decoding's `compile_step`), and the drafter's forward
computed whole (draft.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_eagle31.backends import TargetForwards
from hf_eagle31.backends.cpu import draft, lean, rows
from hf_eagle31.backends.cpu.products import Products, can_pack, products_for
from hf_eagle31.cache import truncate_cache
from hf_eagle31.drafting import DraftForward
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.verification import verify_forward


class CpuBackend:
    name = "cpu"

    def serves(self, target: PreTrainedModel) -> bool:
        return can_pack(target)

    def target_forwards(self, target: PreTrainedModel, target_layer_ids: list[int],
                        compile_verify: bool = False) -> TargetForwards:
        """Both on one set of products. The prefill runs on them too: in bf16 torch's own path reorders every
        weight for oneDNN at each forward, which the products did once."""
        products = products_for(target)
        room = lean.room_for(target, products, compile_verify)

        def forward(**inputs):
            with products.active(mode=True):
                return target(**inputs)

        def verify(cache, plan, tokens, positions, compiled=None):
            if compiled is not None:  # transformers' compiled call (static cache): its graph on the weights as they are
                return verify_forward(target, cache, plan, tokens, positions, target_layer_ids, compiled)
            if room is not None and lean.fits_step(cache, plan):
                with products.active():
                    return lean.llama_verify_forward(target, cache, room, plan, tokens, positions, target_layer_ids)
            with products.active(mode=True):
                return verify_forward(target, cache, plan, tokens, positions, target_layer_ids)

        return TargetForwards(forward, verify, room is not None and room.compiled,
                              torch.ops.hf_eagle31_rows.argmax if rows.rows_kernel() else None,
                              truncate_cache if room is None else room.truncate)

    def products(self, model: nn.Module) -> Products | None:
        return products_for(model) if can_pack(model) else None

    def draft_forward(self, drafter: Eagle3DraftModel, products: Products | None) -> DraftForward | None:
        """The rows library's, where it computes this drafter (draft.py)."""
        return draft.whole_forward(drafter, products)

    def draft_replay(self, drafter: nn.Module) -> None:
        return None  # a CPU waits for nothing between levels: a static draft runs eagerly


CPU = CpuBackend()
