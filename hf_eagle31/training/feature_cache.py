"""An offline cache of the target's outputs, for runs that reuse one dataset many times.

By default features are computed online in each training step (no multi-GB dumps). With a cache
the target's decoder runs once per sequence: the features at `target_layer_ids` and the final
normed state (to which training applies the LM head) go to safetensors shards in a folder. Each
shard holds a fixed run of consecutive sequences and is named by their fingerprint, so an
interrupted build resumes at the first missing shard, and data that grows at the end (more
distilled chunks) computes only the new shards. `index.json` lists the shards of the current data.
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


def _shard(target: PreTrainedModel, sequences: list[TrainingSequence], layer_ids: list[int], path: Path,
           batch_size: int, progress: tqdm) -> None:
    tensors = {}
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].input_ids))  # batches of like lengths pad less
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        chunk = [sequences[i] for i in rows]
        batch = collate([s.as_tensors() for s in chunk])
        ids = batch["input_ids"].to(target.device)
        features, last = target_states(target, ids, batch["attention_mask"].to(target.device), layer_ids)
        for row, (i, s) in enumerate(zip(rows, chunk)):
            n, name = len(s.input_ids), str(i)
            tensors.update({f"{name}.input_ids": batch["input_ids"][row, :n], f"{name}.loss_mask": batch["loss_mask"][row, :n],
                            f"{name}.features": features[row, :n].cpu(), f"{name}.last_hidden": last[row, :n].cpu()})
        progress.update(len(chunk))
    scratch = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(scratch))
    scratch.replace(path)  # a shard exists whole or not at all


@torch.no_grad()
def build_feature_cache(
    target: PreTrainedModel, sequences: list[TrainingSequence], layer_ids: list[int], folder: str | Path,
    batch_size: int = 8, shard_size: int = 64,
) -> FeatureCache:
    """Fill `folder` with the features of `sequences`, computing only the shards it does not hold yet."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not (folder / INDEX).exists() and not any(folder.glob("shard_*")):
        raise ValueError(f"feature cache folder {folder} is not empty and holds no feature cache")
    folder.mkdir(parents=True, exist_ok=True)
    parts = [sequences[i : i + shard_size] for i in range(0, len(sequences), shard_size)]
    names = [f"shard_{n:05d}_{fingerprint(part, layer_ids)[:16]}.safetensors" for n, part in enumerate(parts)]
    missing = [(name, part) for name, part in zip(names, parts) if not (folder / name).exists()]
    with tqdm(total=sum(len(part) for _, part in missing), desc="feature cache", unit="seq") as progress:
        for name, part in missing:
            _shard(target, part, layer_ids, folder / name, batch_size, progress)
    shards = {name: [str(i) for i in range(len(part))] for name, part in zip(names, parts)}
    index = {"fingerprint": fingerprint(sequences, layer_ids), "layer_ids": list(layer_ids), "shards": shards}
    (folder / INDEX).write_text(json.dumps(index))
    return FeatureCache(folder)
