"""The bench's memory roofline: the read bandwidth, the weight bytes a step reads, the floor, the speedup's claim."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle31.bench import roofline
from hf_eagle31.bench.roofline import Roofline, read_bandwidth, speedup_claim, step_bytes


def test_the_read_bandwidth_is_a_plausible_rate_over_a_buffer_beyond_the_cache(monkeypatch):
    assert 1e8 < read_bandwidth(repeats=3) < 1e13  # 0.1 GB/s to 10 TB/s: bytes per second, not bits or seconds
    timed = []
    monkeypatch.setattr(roofline, "best_of", lambda fn, repeats: timed.append(fn().item()) or 0.5)
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda device: 40 * 2**20)
    assert read_bandwidth() == 2 * 8 * 40 * 2**20  # eight caches' bytes in 0.5 s
    assert timed == [pytest.approx(8 * 40 * 2**20 / 4)]  # the sum over a buffer of ones read every float of it
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda device: 0)  # unknown: the least buffer
    assert read_bandwidth() == 2 * 256 * 2**20


def test_the_read_bandwidth_is_probed_on_huge_pages_as_the_weights_are_streamed(monkeypatch):
    """The products' weights go onto 2 MiB pages (pages.py); a probe over 4 KiB pages read a quarter slower here
    (its TLB's rate), so the floor it gave was one a step could beat."""
    collapsed, timed = [], []
    monkeypatch.setattr(roofline.pages, "collapse", lambda tensors: collapsed.extend(tensors) or 1)
    monkeypatch.setattr(roofline, "best_of", lambda fn, repeats: timed.append(fn()) or 0.5)
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda device: 40 * 2**20)
    read_bandwidth()
    assert [t.nbytes for t in collapsed] == [8 * 40 * 2**20]  # the buffer summed, before it is timed
    assert len(timed) == 1


def test_the_bytes_a_step_reads_leave_out_the_embedding_table_unless_it_is_the_head():
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # head_dim 16: k and v project to 32
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # q, o, k, v, gate, up, down, two norms
    weights = 2 * layer + 64 + 256 * 64  # the layers, the final norm, the LM head (once, tied or not)
    for tied in (False, True):
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **shape))
        assert step_bytes(model) == 4 * weights
        assert step_bytes(model.to(torch.bfloat16)) == 2 * weights


def test_the_floor_and_each_rate_over_it_by_hand():
    line = Roofline(bandwidth=20e9, step_bytes=500_000_000, dtype="float32")  # 500 MB at 20 GB/s: 25 ms a step
    assert line.floor_seconds == pytest.approx(0.025) and line.floor_rate == pytest.approx(40.0)
    assert line.of_floor(10.0) == pytest.approx(0.25) and line.of_floor(60.0) == pytest.approx(1.5)
    assert line.describe() == ("read bandwidth 20.0 GB/s, 500 MB of float32 weights a step: floor 25.0 ms/token, "
                               "40.0 tokens/s")
    assert line.as_dict()["floor_tokens_per_second"] == pytest.approx(40.0)


def test_the_floor_is_measured_at_the_fastest_read_of_the_run(monkeypatch):
    """A host's bandwidth moves: the floor takes the fastest probe of the run, this one's or an earlier one's."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    monkeypatch.setattr(roofline, "read_bandwidth", lambda device: 30e9)
    assert Roofline.measure(model).bandwidth == 30e9
    assert Roofline.measure(model, [45e9, 20e9]).bandwidth == 45e9
    assert Roofline.measure(model, [25e9]).bandwidth == 30e9


def test_a_speedup_above_tau_is_said_as_a_handicapped_baseline_not_as_a_result():
    assert speedup_claim(1.5, 1.91, "fast decoding", 0.8) == \
        "speedup over the best plain decoding (fast decoding): 1.50x"
    assert speedup_claim(3.08, 1.91, "fast decoding", 0.25) == (
        "WARNING: speedup over the best plain decoding (fast decoding): 3.08x exceeds tau 1.91: the plain baseline "
        "runs below the memory's rate (25% of the floor rate), so this is not a result")
    assert speedup_claim(3.08, 1.91, "generate").endswith("below the memory's rate, so this is not a result")
