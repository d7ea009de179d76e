"""The `hf-eagle31` command itself: a help that answers at once, defaults shown, packaged names and missing folders
named the same way by every subcommand (issue 29, point 3)."""

import subprocess
import sys
from importlib.metadata import version

import pytest
from tiny_models import make_drafter, make_target

import hf_eagle31_cli
from hf_eagle31.cli import main as cli_main
from hf_eagle31.packaged import PACKAGED, PackagedModel


def test_help_imports_neither_torch_nor_any_subcommand():
    """`hf-eagle31 --help` took 5 s importing every subcommand (and with them torch); now the static table answers."""
    code = ("import sys, hf_eagle31_cli\ntry:\n    hf_eagle31_cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'hf_eagle31')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in hf_eagle31_cli.SUBCOMMANDS) and out.strip().endswith("[]")


def test_version(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--version"])
    assert capsys.readouterr().out.strip() == f"hf-eagle31 {version('hf-eagle31')}"


@pytest.mark.parametrize("command", sorted(hf_eagle31_cli.SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(command):
    parser = hf_eagle31_cli.build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert [a.dest for a in sub._actions if not a.help] == []
    text = sub.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    if command == "train":
        assert "peak learning rate (AdamW, warmup then cosine decay) (default: 0.0001)" in " ".join(text.split())


def test_plan_takes_a_packaged_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_EAGLE31_CACHE", str(tmp_path))
    monkeypatch.setitem(PACKAGED, "tiny-packaged", PackagedModel("unused", "x.gguf", "pip install x", "acme/tiny"))
    make_target().save_pretrained(tmp_path / "tiny-packaged")
    assert cli_main(["plan", "--target", "tiny-packaged", "--json"]) == 0
    assert '"context": 8192' in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["convert", "/nonexistent", "{tmp}/out"],
                                  ["train", "--target", "{target}", "--data", "x.jsonl", "--out", "{tmp}/out",
                                   "--steps", "1", "--drafter", "./nonexistent"],
                                  ["bench", "--eagle31", "~/nonexistent", "--out", "{tmp}/out"],
                                  ["convert", "{drafter}", "{tmp}/out", "--upgrade", "--target", "no/such/folder",
                                   "--data", "x.jsonl"]])
def test_a_missing_folder_is_named_before_anything_loads(tmp_path, capsys, argv):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    names = {"tmp": tmp_path, "target": tmp_path / "target", "drafter": tmp_path / "drafter"}
    assert cli_main([arg.format(**names) for arg in argv]) == 2
    missing = next(arg for arg in argv if "nonexistent" in arg or "no/such" in arg)
    assert capsys.readouterr().err.strip().endswith(f"error: no such folder: {missing}")
    assert not (tmp_path / "out").exists()
