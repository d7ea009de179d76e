"""The transformers range the package claims is the range CI tests, and the quickstart's path works on the installed
release (`make test` runs this file on the dev pin and on the oldest and newest supported transformers)."""

from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModel, AutoModelForCausalLM

from hf_eagle31 import compat
from tiny_models import make_drafter, make_target

ROOT = Path(__file__).resolve().parent.parent


def pinned(requirements: str, package: str) -> str:
    match = re.search(rf"^{package}==(\S+)", (ROOT / requirements).read_text(), re.MULTILINE)
    assert match, f"{requirements} pins no {package}"
    return match.group(1)


def test_the_range_claimed_is_the_range_tested():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    claimed = next(d for d in dependencies if d.startswith("transformers"))
    newest = compat.NEWEST_TRANSFORMERS.split(".")
    assert claimed == f"transformers>={compat.OLDEST_TRANSFORMERS.rsplit('.0', 1)[0]},<{newest[0]}.{int(newest[1]) + 1}"
    assert pinned("requirements-newest.txt", "transformers") == compat.NEWEST_TRANSFORMERS
    assert pinned("requirements-oldest.txt", "transformers") == compat.OLDEST_TRANSFORMERS
    oldest, dev = Version(compat.OLDEST_TRANSFORMERS), Version(pinned("requirements-dev.txt", "transformers"))
    assert oldest <= dev <= Version(compat.NEWEST_TRANSFORMERS)


def test_an_older_transformers_is_refused_by_name():
    with pytest.raises(ImportError, match=r"transformers 5\.16\.1 is installed.*pip install 'transformers>=5\.17\.0,<5\.26'"):
        compat.check_transformers("5.16.1")


def test_a_newer_transformers_is_warned_about_naming_the_tested_range():
    with pytest.warns(compat.UntestedTransformersWarning, match=r"tested on transformers 5\.17\.0 to 5\.25\.x"):
        compat.check_transformers("5.26.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in (compat.OLDEST_TRANSFORMERS, "5.20.2", "5.25.9", transformers.__version__):
            compat.check_transformers(version)


def test_the_quickstart_path_equals_plain_generate(tmp_path, monkeypatch):
    """Saved and loaded through the Auto classes, as the quickstart does; the cache handed back under the name this
    transformers uses, ready to continue the conversation. On 5.24 it failed in the routing (the cache's new name);
    on 5.25 without the `kernels` package the drafter did not load (Hub kernels are on by default there): the target
    is loaded as the README says, the drafter as is."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    target, drafter = make_target(), make_drafter(make_target())
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", **compat.LOAD_KWARGS).eval()
    drafter = AutoModel.from_pretrained(tmp_path / "drafter").eval()
    prompt = torch.tensor([[1, 17, 43, 99, 5, 200]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    cache = out[compat.CACHE_KWARG]
    assert cache.get_seq_length() == plain.shape[1] - 1
    more = torch.cat([plain, torch.tensor([[7, 8]])], dim=1)
    continued = target.generate(more, assistant_model=drafter, do_sample=False, max_new_tokens=8,
                                **{compat.CACHE_KWARG: cache})
    assert torch.equal(continued, target.generate(more, do_sample=False, max_new_tokens=8))

