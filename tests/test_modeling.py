"""The drafter implements SPEC section 2 exactly, loads and saves like any transformers model."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import drafter_config, make_drafter, make_target
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_eagle31
from hf_eagle31 import Eagle3Config, Eagle3DraftModel
from hf_eagle31.training.capacity import add_decoder_layers
from hf_eagle31.modeling import rotary_rows


def rms(x, weight, eps):
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_draft_step(d: Eagle3DraftModel, input_ids, features):
    """SPEC section 2 written out with plain tensor ops (no cache, causal), from the drafter's weights."""
    c, eps, layer = d.config, d.config.rms_norm_eps, d.midlayer
    g = features
    if features.shape[-1] == 3 * c.target_hidden_size:
        if c.fc_norm:
            g = torch.cat([rms(p, n.weight, eps) for p, n in zip(g.chunk(3, -1), d.fc_norm)], -1)
        g = g @ d.fc.weight.T
    e = d.get_input_embeddings().weight[input_ids]
    batch, length = input_ids.shape
    cos, sin = d.rotary_emb(g, torch.arange(length)[None])

    def attention(a, h):
        split = lambda x: x.view(batch, length, -1, c.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(h @ a.q_proj.weight.T), split(h @ a.k_proj.weight.T), split(h @ a.v_proj.weight.T)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2)) * c.head_dim**-0.5
        scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1) @ a.o_proj.weight.T

    def mlp(m, y):
        return (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T

    h = torch.cat([rms(e, layer.input_layernorm.weight, eps), rms(g, layer.hidden_norm.weight, eps)], -1)
    x = g + attention(layer.self_attn, h)
    x = x + mlp(layer.mlp, rms(x, layer.post_attention_layernorm.weight, eps))
    for stacked in d.layers.values():  # num_hidden_layers > 1: plain pre-norm layers
        x = x + attention(stacked.self_attn, rms(x, stacked.input_layernorm.weight, eps))
        x = x + mlp(stacked.mlp, rms(x, stacked.post_attention_layernorm.weight, eps))
    normed = rms(x, d.norm.weight, eps)
    return normed @ d.lm_head.weight.T, (normed if c.norm_output else x)


@pytest.mark.parametrize("fc_norm, norm_output, layers", [(False, False, 1), (False, True, 1), (True, False, 1),
                                                           (True, True, 1), (True, True, 3)])
def test_draft_step_matches_the_spec(fc_norm, norm_output, layers):
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=False, fc_norm=fc_norm, norm_output=norm_output, num_hidden_layers=layers)
    with torch.no_grad():
        for norm in drafter.fc_norm or []:
            norm.weight.uniform_(0.5, 2.0)  # make the three norms differ, as trained ones do
    ids = torch.randint(3, 256, (2, 7))
    features = torch.randn(2, 7, 3 * 64) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(64)
    with torch.no_grad():
        out = drafter(ids, features)
        logits, feedback = reference_draft_step(drafter, ids, features)
        torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden_states, feedback, atol=1e-4, rtol=1e-4)
        again = drafter(ids, out.hidden_states)  # a fed-back state (width H) skips fc
        torch.testing.assert_close(again.logits, reference_draft_step(drafter, ids, out.hidden_states)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_rows_equal_the_rotary_embedding_at_every_position(dtype):
    """`rotary_rows` (the drafter's `rotary_at`, the lean forward's) reads rows of a table it grows as positions pass
    its end; each row must be what the rotary embedding computes for that position alone, bit for bit, in each dtype
    (a table per dtype)."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    like = torch.zeros(1, 1, drafter.config.hidden_size, dtype=dtype)
    tables = {}  # the target's, as the lean forward keeps them: sized by a bound on the positions, not by reading them
    for positions in ([[0, 1, 2]], [[255, 256, 700]], [[3000, 5, 4999]], [[7, 7, 8]]):  # grows twice, then reads
        positions = torch.tensor(positions)
        expected = drafter.rotary_emb(like, positions)
        got = drafter.rotary_at(like, positions)
        assert all(g.dtype == dtype and torch.equal(g, e) for g, e in zip(got, expected))
        expected = target.model.rotary_emb(like, positions)
        got = rotary_rows(target.model.rotary_emb, like, positions, tables, int(positions.max()) + 1)
        assert all(g.dtype == dtype and torch.equal(g, e) for g, e in zip(got, expected))


def test_fc_norm_is_three_separate_norms_not_one():
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    low, mid, high = torch.randn(3, 1, 1, 64).unbind(0)
    features = torch.cat([low, 1000 * mid, high], -1)
    fused = drafter.project_target_features(features)
    single_norm = drafter.fc(F.rms_norm(features, (192,), eps=drafter.config.rms_norm_eps))
    assert not torch.allclose(fused, single_norm, atol=1e-3)
    scaled = drafter.project_target_features(torch.cat([low, mid, high], -1))
    torch.testing.assert_close(fused, scaled, atol=1e-4, rtol=1e-4)  # per-part scale is normalised away


def test_target_embedding_is_shared_not_copied():
    target = make_target("llama")
    drafter = Eagle3DraftModel(drafter_config(target, include_embedding=True))
    assert drafter.embed_tokens is not None
    drafter.set_target_embedding(target.get_input_embeddings())
    assert drafter.get_input_embeddings() is target.get_input_embeddings()
    assert drafter.embed_tokens is None and "embed_tokens.weight" not in drafter.state_dict()
    assert all(p.data_ptr() != target.get_input_embeddings().weight.data_ptr() for p in drafter.parameters())


def test_save_and_load_round_trip_bit_exactly(tmp_path):
    target = make_target("qwen2")
    drafter = make_drafter(target, eagle31=True, draft_vocab_size=128)
    drafter.d2t[:] = torch.arange(128)  # target id = 2 * draft id
    drafter.t2d.zero_()
    drafter.t2d[::2] = True
    drafter.generation_config.tree_depth = 4
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    for loader in (Eagle3DraftModel, transformers.AutoModel):
        loaded = loader.from_pretrained(tmp_path)
        assert type(loaded) is Eagle3DraftModel and loaded.generation_config.tree_depth == 4
        for (name, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == Eagle3Config.model_type
    assert int(loaded.draft_to_target(torch.tensor([5]))) == 10


def test_default_layer_ids_are_low_mid_high():
    config = Eagle3Config(num_target_layers=32)
    assert config.target_layer_ids == [2, 16, 29]
    assert hf_eagle31.Eagle3Config(num_target_layers=6).target_layer_ids == [2, 3, 3]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(vocab_size=100, draft_vocab_size=200), "draft_vocab_size"),
        (dict(num_target_layers=6, target_layer_ids=[2, 3, 9]), "out of range"),
        (dict(target_layer_ids=[2, 3]), "3 target layers"),
        (dict(num_attention_heads=4, num_key_value_heads=3, hidden_size=64), "multiple"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
    ],
)
def test_bad_configs_are_refused_with_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        Eagle3Config(**fields)


def test_wrong_feature_width_and_missing_embedding_are_named():
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="width 100"):
        drafter(torch.tensor([[5]]), torch.randn(1, 1, 100))
    orphan = Eagle3DraftModel(drafter_config(target))
    with pytest.raises(ValueError, match="no input embedding"):
        orphan(torch.tensor([[5]]), torch.randn(1, 1, 192))
    with pytest.raises(ValueError, match="expects a vocabulary"):
        orphan.set_target_embedding(torch.nn.Embedding(100, 64))


def test_added_decoder_layers_start_as_the_identity_and_round_trip(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    ids, features = torch.randint(3, 256, (2, 7)), torch.randn(2, 7, 3 * 64)
    with torch.no_grad():
        before = drafter(ids, features)
        add_decoder_layers(drafter, 2)
        grown = drafter(ids, features)
        torch.testing.assert_close(grown.logits, before.logits, atol=0, rtol=0)
        drafter.layers["1"].mlp.down_proj.weight.normal_(std=0.1)  # trained away from the identity
        assert not torch.allclose(drafter(ids, features).logits, before.logits, atol=1e-3)
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    loaded.set_target_embedding(target.get_input_embeddings())
    assert loaded.config.num_hidden_layers == 2 and "layers.1.self_attn.q_proj.weight" in loaded.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, features).logits, drafter(ids, features).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cannot be grown to 1"):
        add_decoder_layers(drafter, 1)


def test_a_cached_step_of_a_stacked_drafter_equals_the_full_forward():
    """Each decoder layer keeps its own cache layer: a block drafted after a cached prefix sees the prefix's keys
    of its own layer, as the uncached forward over the whole sequence does."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True, num_hidden_layers=3)
    ids, features = torch.randint(3, 256, (1, 9)), torch.randn(1, 9, 3 * 64)
    with torch.no_grad():
        full = drafter(ids, features).logits
        cache = transformers.DynamicCache()
        drafter(ids[:, :6], features[:, :6], cache=cache)
        assert len(cache.layers) == 3
        step = drafter(ids[:, 6:], features[:, 6:], cache=cache).logits
    torch.testing.assert_close(step, full[:, 6:], atol=1e-5, rtol=1e-5)


def test_the_cache_is_also_taken_and_returned_as_past_key_values():
    """issue 73: code written before transformers 5.24 (training loops, harnesses calling a loaded head) passes and
    reads the drafter's cache as `past_key_values`; since the rename that was a TypeError. Both names give the
    cache= step's output on every release; both at once is refused by name."""
    target = make_target("llama")
    drafter = make_drafter(target, eagle31=True)
    ids, features = torch.randint(3, 256, (1, 9)), torch.randn(1, 9, 3 * 64)
    with torch.no_grad():
        steps = {}
        for name in ("cache", "past_key_values"):
            cache = transformers.DynamicCache()
            out = drafter(ids[:, :6], features[:, :6], **{name: cache})
            assert out.past_key_values is cache and out.cache is cache
            steps[name] = drafter(ids[:, 6:], features[:, 6:], **{name: cache}).logits
        assert torch.equal(steps["past_key_values"], steps["cache"])
        with pytest.raises(ValueError, match=r"both cache= and past_key_values=.*pass the cache once"):
            drafter(ids, features, cache=transformers.DynamicCache(), past_key_values=transformers.DynamicCache())
