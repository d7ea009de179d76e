"""An offline cache of the target's outputs, for runs that reuse one dataset many times.

By default features are computed online in each training step (no multi-GB dumps). With a cache
the target's decoder runs once per sequence: the features at `target_layer_ids` and the final
normed state (to which training applies the LM head) go to safetensors shards in a folder, with
an `index.json` fingerprinting the sequences and layers they belong to.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_eagle31.training.data import TrainingSequence, collate
from hf_eagle31.training.teacher import target_states

INDEX = "index.json"


def fingerprint(sequences: list[TrainingSequence], layer_ids: list[int]) -> str:
    digest = hashlib.sha256(json.dumps(list(layer_ids)).encode())
    for s in sequences:
        digest.update(json.dumps([s.input_ids, s.loss_mask]).encode())
    return digest.hexdigest()


class FeatureCache(torch.utils.data.Dataset):
    """Training items with precomputed `features` and `last_hidden`, read lazily from the shards."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / INDEX).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"feature cache {self.folder} is unreadable: {err}") from None
        self.locations = [(shard, key) for shard, keys in self.index["shards"].items() for key in keys]
        self._open: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.locations)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, key = self.locations[index]
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.folder / shard), framework="pt")
        handle = self._open[shard]
        return {name: handle.get_tensor(f"{key}.{name}") for name in ("input_ids", "loss_mask", "features", "last_hidden")}


@torch.no_grad()
def build_feature_cache(
    target: PreTrainedModel, sequences: list[TrainingSequence], layer_ids: list[int], folder: str | Path,
    batch_size: int = 8, shard_size: int = 256,
) -> FeatureCache:
    """Fill `folder` (or reuse it when it already holds these sequences' features)."""
    folder = Path(folder)
    key = fingerprint(sequences, layer_ids)
    if (folder / INDEX).exists():
        cache = FeatureCache(folder)
        if cache.index.get("fingerprint") != key:
            raise ValueError(f"feature cache {folder} was built for other data or target layers; "
                             "point --feature-cache at an empty folder")
        return cache
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"feature cache folder {folder} is not empty and holds no {INDEX}")
    folder.mkdir(parents=True, exist_ok=True)
    shards, pending = {}, {}
    for start in tqdm(range(0, len(sequences), batch_size), desc="feature cache", unit="batch"):
        chunk = sequences[start : start + batch_size]
        batch = collate([s.as_tensors() for s in chunk])
        ids = batch["input_ids"].to(target.device)
        features, last = target_states(target, ids, batch["attention_mask"].to(target.device), layer_ids)
        for row, s in enumerate(chunk):
            n, name = len(s.input_ids), str(start + row)
            pending.update({f"{name}.input_ids": batch["input_ids"][row, :n], f"{name}.loss_mask": batch["loss_mask"][row, :n],
                            f"{name}.features": features[row, :n].cpu(), f"{name}.last_hidden": last[row, :n].cpu()})
            if len(pending) >= 4 * shard_size or start + row == len(sequences) - 1:
                shard = f"shard_{len(shards):05d}.safetensors"
                save_file({k: v.contiguous() for k, v in pending.items()}, str(folder / shard))
                shards[shard] = sorted({k.split(".")[0] for k in pending}, key=int)
                pending = {}
    (folder / INDEX).write_text(json.dumps({"fingerprint": key, "layer_ids": list(layer_ids), "shards": shards}))
    return FeatureCache(folder)
