"""pyproject.toml declares what the package imports and nothing else; triton is an extra the package imports
without (issue 29, point 4)."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tiny_models import PROMPTS, trained_pair

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["hf_eagle31", "hf_eagle31_cli.py"]
DISTRIBUTIONS = {"yaml": "pyyaml"}  # import name -> distribution name, where they differ
USED_THROUGH_TRANSFORMERS = {"bitsandbytes", "gguf"}  # transformers imports them: a quantized or a GGUF target
LOCAL = {"hf_eagle31", "hf_eagle31_cli"}


def imported() -> set[str]:
    files = [p for source in SOURCES for p in ([REPO / source] if source.endswith(".py") else (REPO / source).rglob("*.py"))]
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return {DISTRIBUTIONS.get(n, n).replace("_", "-") for n in names - LOCAL - set(sys.stdlib_module_names)}


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [req for name, reqs in project["optional-dependencies"].items() if name != "test" for req in reqs]
    return {req.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for req in project["dependencies"] + extras}


def test_pyproject_declares_what_is_imported_and_nothing_else():
    assert imported() - declared() == set()  # rich (plan) and pyyaml (cards) were imported undeclared
    assert declared() - imported() == USED_THROUGH_TRANSFORMERS  # datasets and tokenizers were declared unused


def test_triton_is_an_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(req.startswith("triton") for req in project["dependencies"])
    assert any(req.startswith("triton") for req in project["optional-dependencies"]["kernels"])


def test_every_module_imports_without_triton():
    code = ("import sys, pkgutil, importlib\nsys.modules['triton'] = None\nimport hf_eagle31\n"
            "for m in pkgutil.walk_packages(hf_eagle31.__path__, 'hf_eagle31.'):\n"
            "    if m.name != 'hf_eagle31.kernels.tree_attention_triton':\n        importlib.import_module(m.name)\n"
            "print('imported')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"})
    assert result.stdout.strip() == "imported", result.stderr[-2000:]


def test_the_kernel_mode_without_triton_names_the_extra(monkeypatch):
    target, drafter = trained_pair("llama", True, verify_mode="kernel")
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'hf-eagle31\[kernels\]'"):
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=5, assistant_model=drafter)
