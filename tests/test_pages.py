"""Huge pages under the weights the CPU backend streams (hf_eagle31/backends/cpu/pages.py): in place, the same
addresses and values, or nothing where Linux cannot."""

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import PROMPTS, make_target
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_eagle31
from hf_eagle31.backends.cpu import pages
from hf_eagle31.backends.cpu import products as cpu_products
from hf_eagle31.backends.cpu.products import Products, can_pack


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mappings (/proc/self/maps)")


def collapsing() -> bool:
    """Whether this system moves memory onto huge pages in place: Linux 6.1 or later, huge pages not turned off."""
    if pages._madvise() is None:
        return False
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return enabled.exists() and "[never]" not in enabled.read_text() and (major, minor) >= (6, 1)


def huge_kib() -> int:
    """The process's anonymous memory on huge pages, in KiB."""
    return sum(int(line.split()[1]) for line in Path("/proc/self/smaps").read_text().splitlines()
               if line.startswith("AnonHugePages:"))


def collapsed(tensors) -> int:
    """`pages.collapse(tensors)`, skipping the test where Linux has no huge page to give at the moment (it says so with
    EAGAIN or ENOMEM: memory fragmented, or in use); any other refusal fails it."""
    done = pages.collapse(tensors)
    if not done:
        start = min(t.data_ptr() for t in tensors)
        first = -(-start // pages.HUGE_PAGE) * pages.HUGE_PAGE
        refused = pages._madvise()(first, pages.HUGE_PAGE, pages.MADV_COLLAPSE) and ctypes.get_errno()
        if refused in (errno.EAGAIN, errno.ENOMEM):
            pytest.skip(f"Linux gave no huge page now ({errno.errorcode[refused]})")
        assert not refused, f"madvise(MADV_COLLAPSE) refused: {errno.errorcode.get(refused, refused)}"
    return done


def fresh(floats: int) -> torch.Tensor:
    """Random floats on memory mapped for the test alone: memory with a history can be refused in part (in the full
    suite's long process Linux collapsed 3 of the 5 ranges of a 12 MiB tensor on the heap)."""
    memory = mmap.mmap(-1, floats * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.float32).normal_()


@pytest.mark.skipif(not collapsing(), reason="Linux 6.1+ with huge pages not turned off moves memory onto them")
def test_weights_go_onto_huge_pages_in_place():
    weight = fresh(3 << 20)  # 12 MiB: five aligned 2 MiB ranges at least
    address, values, before = weight.data_ptr(), weight.clone(), huge_kib()
    done = collapsed([weight])
    assert done >= 5 and huge_kib() - before >= done * 2048
    assert weight.data_ptr() == address and torch.equal(weight, values)
    assert pages.collapse([weight]) == done  # already there: done again at once


@pytest.mark.skipif(not collapsing(), reason="Linux 6.1+ with huge pages not turned off moves memory onto them")
def test_tensors_side_by_side_are_one_span():
    """A model's weights lie one after another, each smaller than a huge page (SmolLM2's o_proj: 0.66 MB in bf16):
    alone, none holds an aligned 2 MiB range."""
    layers = fresh(9 << 18)[: 8 << 18].split(1 << 18)  # eight 1 MiB weights side by side
    assert sum(pages.collapse([weight]) for weight in layers) == 0
    assert pages._spans(layers) == [(layers[0].data_ptr(), layers[-1].data_ptr() + layers[-1].nbytes)]
    assert collapsed(layers) >= 3


def mapped(path: Path, size: int, flags: int) -> tuple[torch.Tensor, bytes]:
    """A file of `size` random bytes mapped (MAP_PRIVATE: as safetensors maps a checkpoint), as a tensor."""
    data = os.urandom(size)
    path.write_bytes(data)
    with open(path, "rb+") as file:
        memory = mmap.mmap(file.fileno(), 0, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(memory, dtype=torch.uint8), data


def on_file(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is a file's mapping (a named inode in /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        first, last = (int(address, 16) for address in line.split()[0].split("-"))
        if first <= tensor.data_ptr() < last:
            return line.split()[4] != "0"
    raise AssertionError("the tensor's memory is not mapped")


@pytest.mark.skipif(not collapsing(), reason="Linux 6.1+ with huge pages not turned off moves memory onto them")
def test_a_files_private_mapping_moves_onto_huge_pages_in_place(tmp_path, monkeypatch):
    """Weights loaded from safetensors in the checkpoint's own dtype are the file, mapped privately: 4 KiB pages
    Linux does not collapse. They move onto anonymous memory, a chunk at a time: the same addresses and values, the
    file untouched."""
    monkeypatch.setattr(pages, "CHUNK", 4 << 20)  # six chunks or seven
    weight, data = mapped(tmp_path / "weights.bin", 24 << 20, mmap.MAP_PRIVATE)
    address, values, before = weight.data_ptr(), weight.clone(), huge_kib()
    assert on_file(weight)
    done = collapsed([weight])
    assert done >= 11 and huge_kib() - before >= done * 2048
    assert not pages._file_mappings(address, address + weight.nbytes)  # no part left on the file
    assert weight.data_ptr() == address and torch.equal(weight, values)
    weight[:4096] = 7  # writable as before, and still private: the file keeps its bytes
    assert (tmp_path / "weights.bin").read_bytes() == data
    assert pages.collapse([weight]) == done  # moved once: done again at once


@pytest.mark.skipif(not collapsing(), reason="Linux 6.1+ with huge pages not turned off moves memory onto them")
def test_a_long_move_is_announced_once(tmp_path, monkeypatch, caplog):
    """Moving a large checkpoint pauses the first call (about 2 s a GB on a KVM guest): it says so, once."""
    monkeypatch.setattr(pages, "ANNOUNCED", 16 << 20)
    small, _ = mapped(tmp_path / "small.bin", 8 << 20, mmap.MAP_PRIVATE)
    large, _ = mapped(tmp_path / "large.bin", 24 << 20, mmap.MAP_PRIVATE)
    with caplog.at_level("WARNING", logger=pages.__name__):
        collapsed([small])
        assert not caplog.records
        collapsed([large])
        collapsed([large])
    assert len(caplog.records) == 1 and "of weights mapped from their checkpoint file" in caplog.records[0].getMessage()


@linux
def test_a_files_shared_mapping_is_left_as_it_is(tmp_path, monkeypatch):
    """Writes to a shared mapping reach the file: it stays, and after a few refusals the rest is not asked for
    (each generate call asks again)."""
    weight, _ = mapped(tmp_path / "weights.bin", 64 << 20, mmap.MAP_SHARED)
    values = weight.clone()
    advise, asked = pages._madvise(), []
    if advise is not None:
        monkeypatch.setattr(pages, "_madvise", lambda: lambda *args: asked.append(args) or advise(*args))
    assert pages.collapse([weight]) == 0 and torch.equal(weight, values) and on_file(weight)
    assert len(asked) <= pages.REFUSALS


@linux
def test_a_mapping_past_its_files_end_stays(tmp_path):
    """A file cut short after it was mapped: its pages past the end cannot be read (SIGBUS), so its mapping stays
    (in a process of its own: a read there would end the process)."""
    code = textwrap.dedent(f"""
        import mmap, os, torch
        from hf_eagle31.backends.cpu import pages
        path = {str(tmp_path / "weights.bin")!r}
        with open(path, "wb") as file:
            file.write(os.urandom(24 << 20))
        with open(path, "rb+") as file:
            memory = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            file.truncate(8 << 20)
        weight = torch.frombuffer(memory, dtype=torch.uint8)[: 8 << 20]
        done = pages.collapse([weight])
        for line in open("/proc/self/maps"):
            first, last = (int(address, 16) for address in line.split()[0].split("-"))
            if first <= weight.data_ptr() < last:
                print(done, line.split()[4] != "0")  # still the file's mapping
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["0", "True"], done.stderr[-2000:]


@linux
def test_a_file_stays_where_linux_collapses_nothing(tmp_path, monkeypatch):
    """An older kernel refuses every range: moving the file's mapping would copy it for nothing."""
    weight, _ = mapped(tmp_path / "weights.bin", 24 << 20, mmap.MAP_PRIVATE)
    monkeypatch.setattr(pages, "_collapses", lambda: False)
    assert pages.collapse([weight]) == 0 and on_file(weight)


@pytest.mark.skipif(not collapsing() or not can_pack(make_target()),
                    reason="Linux 6.1+ with huge pages, and the CPU backend (a CPU build with mkldnn)")
def test_a_target_loaded_from_its_file_decodes_off_it(tmp_path):
    """transformers maps a checkpoint loaded in its own dtype; the first `fast_decoding` call moves the weights off
    the file: the same tokens as plain `generate`, every weight at its address with its values."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    before = {name: (weight.data_ptr(), weight.detach().clone()) for name, weight in target.named_parameters()}
    assert all(on_file(weight) for weight in target.parameters())
    plain = target.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=8)
    fast = target.generate(PROMPTS[:1, :6], do_sample=False, max_new_tokens=8, custom_generate=hf_eagle31.fast_decoding)
    assert torch.equal(fast, plain)
    for name, weight in target.named_parameters():
        assert not on_file(weight) and weight.data_ptr() == before[name][0] and torch.equal(weight, before[name][1])


def test_nothing_is_asked_where_there_is_no_madvise(monkeypatch):
    monkeypatch.setattr(pages, "_madvise", lambda: None)
    assert pages.collapse([torch.randn(3 << 20)]) == 0


@pytest.mark.skipif(not can_pack(make_target()), reason="the CPU backend needs a CPU build with mkldnn")
def test_a_models_products_ask_for_every_weight_they_stream(monkeypatch):
    asked = []
    monkeypatch.setattr(cpu_products.pages, "collapse", lambda tensors: asked.extend(tensors) or 0)
    target = make_target()
    Products(target)
    linears = [module for module in target.modules() if isinstance(module, torch.nn.Linear)]
    assert {id(weight) for weight in asked} == {id(linear.weight) for linear in linears}
