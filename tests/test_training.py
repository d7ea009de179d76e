"""The training pipeline, each piece against a plain reference: masks built by hand, inference-time
chain drafting, losses written as loops, hand-counted vocabularies, an uninterrupted run."""

import copy
import csv
import json
import math

import pytest
import torch
from tiny_models import PROMPTS, make_drafter, make_target, make_tokenizer, trained_pair
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.cli import main as cli_main
from hf_eagle31.drafting import DrafterState
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.training import evaluate_acceptance, train_drafter
from hf_eagle31.training.data import TrainingSequence, fit_length, self_distill
from hf_eagle31.training.losses import acceptance_loss, distillation_losses, step_mask
from hf_eagle31.training.ttt import ttt_tail_mask, unroll
from hf_eagle31.training.vocab import build_draft_vocab, token_counts, widen_draft_vocab

FAST = dict(lr=1e-2, batch_size=8, save_every=1000, tune_prompts=0)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def distilled(target):
    """The target's greedy answers to random prompts: 32 to train on, 16 held out."""
    prompts = torch.randint(3, 256, (48, 6), generator=torch.Generator().manual_seed(1)).tolist()
    sequences = self_distill(target, prompts, max_new_tokens=24, batch_size=48)
    return sequences[:32], sequences[32:]


def records(sequences):
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in sequences]


@pytest.fixture(scope="module")
def trained(target, distilled, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    drafter = train_drafter(target, records(distilled[0]), out, steps=30, **FAST)
    return drafter, out


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- the unroll -----------------------------------------------------------------------------------


def test_ttt_tail_mask_matches_hand_built_reference():
    length, step = 5, 3
    reference = torch.zeros(length, (step + 1) * length, dtype=torch.bool)
    for t in range(length):
        for block in range(step + 1):
            for s in range(length):
                # the chain rooted at t sees the target-feature entries up to t, then only its own drafts
                reference[t, block * length + s] = s <= t if block == 0 else s == t
    assert torch.equal(ttt_tail_mask(length, step), reference)


@pytest.mark.parametrize("eagle31", [True, False])
def test_unroll_equals_inference_time_chains(target, eagle31):
    """Step k at position t of the unroll is what chain drafting computes at depth k from a context ending at t."""
    drafter = make_drafter(target, eagle31=eagle31)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        features = select_features(target(ids, output_hidden_states=capture_request(layer_ids)).hidden_states, layer_ids)
        steps = [out.logits for out in unroll(drafter, features, ids, 4)]
    for t in range(ids.shape[1] - 5):
        state = DrafterState(drafter)
        state.push(features[:, : t + 1], ids[:, 1 : t + 2])
        hidden, logits = state.catch_up()
        for k, token in enumerate(ids[0, t + 2 : t + 6].tolist()):  # the chain is fed the sequence's own tokens
            torch.testing.assert_close(steps[k][0, t], logits[0, -1], rtol=1e-4, atol=1e-5)
            seen = torch.ones(1, 1, k + 1, dtype=torch.bool)  # as a draft level sees the levels before it
            out = state.draft_forward(torch.tensor([[token]]), hidden, k + 1, seen)  # one vocabulary: ids are ids
            hidden, logits = out.hidden_states, out.logits


@pytest.mark.parametrize("eagle31", [True, False])
def test_generate_accepts_at_each_root_what_the_unroll_predicts(monkeypatch, eagle31):
    """End to end, root by root: each step of greedy chain `generate` accepts as many draft tokens as the unroll of
    its output says a chain rooted there would. The training measure is then the decoding itself, and a drafter fed
    other features, positions or cache live than in training fails here, though its output stays the target's."""
    target, drafter = trained_pair(eagle31=eagle31, speculation_mode="chain", num_assistant_tokens=4,
                                   dynamic_speculation=False, collapse_fallback=False)
    layer_ids, steps = drafter.config.target_layer_ids, []
    record_step = SpeculationStats.record_step
    monkeypatch.setattr(SpeculationStats, "record_step", lambda self, proposed, accepted, emitted, *rest: (
        steps.append((proposed, accepted, emitted)), record_step(self, proposed, accepted, emitted, *rest)))
    accepted_somewhere = False
    for prompt in PROMPTS[:3]:
        steps.clear()
        out = target.generate(prompt[None], max_new_tokens=40, do_sample=False, assistant_model=drafter, pad_token_id=0)
        with torch.no_grad():
            states = target(out, output_hidden_states=capture_request(layer_ids)).hidden_states
            chain = unroll(drafter, select_features(states, layer_ids), out, 4)
        root = prompt.shape[0] - 1  # the first step drafts after the prefill's token, from the prompt's last state
        for proposed, accepted, emitted in steps[:-1]:  # the last step may stop early (length, end of text)
            predicted = 0
            while predicted < proposed and int(drafter.draft_to_target(
                    chain[predicted].logits[0, root].argmax())) == int(out[0, root + predicted + 2]):
                predicted += 1
            assert accepted == predicted, (root, proposed)
            accepted_somewhere |= accepted >= 2
            root += emitted
    assert accepted_somewhere  # the pair accepts chains, so the comparison covers depths past the first


def test_unroll_gradients_reach_every_step(target):
    """The cache carries gradients: a loss on step 3 alone trains the projections of step 0's keys."""
    drafter = make_drafter(target).train()
    ids = torch.randint(3, 256, (2, 7))
    features = torch.randn(2, 7, 3 * 64)
    unroll(drafter, features, ids, 4)[3].logits.sum().backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.midlayer.self_attn.k_proj.weight.grad.abs().sum() > 0


# --- losses and vocabulary -----------------------------------------------------------------------


def test_step0_loss_is_the_teacher_forced_distillation_loss(target, distilled):
    """With one step and the full vocabulary the loss is EAGLE's teacher-forced soft cross-entropy
    (as in tiny_models.distill: drafter(x[1:], F[:-1]) against softmax of the target's logits[1:])
    minus the target's entropy."""
    drafter = make_drafter(target)
    sequences = [s for s in distilled[0] if len(s.input_ids) == len(distilled[0][0].input_ids)][:4]
    ids = torch.tensor([s.input_ids for s in sequences])
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        out = target(ids, output_hidden_states=capture_request(layer_ids))
        features = select_features(out.hidden_states, layer_ids)
        logits = drafter(ids[:, 1:], features[:, :-1]).logits
    p = torch.softmax(out.logits[:, 1:-1], -1)  # the last position would predict past the sequence
    log_q = torch.log_softmax(logits[:, :-1], -1)
    keep = torch.tensor([s.loss_mask for s in sequences])[:, 2:].bool()
    cross_entropy = -(p * log_q).sum(-1)[keep].mean()
    entropy = -(p * p.log()).sum(-1)[keep].mean()
    mask = torch.tensor([s.loss_mask for s in sequences])
    with torch.no_grad():
        counted = unroll(drafter, features, ids, 1, mask)[0].logits  # the head only where the loss counts
    torch.testing.assert_close(counted, logits[step_mask(mask, 0, ids.shape[1] - 1)])
    loss = distillation_losses((counted,), out.logits, mask)
    torch.testing.assert_close(loss[0], cross_entropy - entropy, rtol=1e-4, atol=1e-5)


def test_distillation_losses_against_loops():
    """Later steps read the target one position further ahead; the draft vocabulary is renormalised."""
    torch.manual_seed(0)
    batch, length, vocab = 2, 6, 5
    steps = tuple(torch.randn(batch, length - 1, vocab) for _ in range(3))
    target_logits = torch.randn(batch, length, vocab)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    counted = tuple(logits[step_mask(mask, k, length - 1)] for k, logits in enumerate(steps))
    losses = distillation_losses(counted, target_logits, mask)
    for k in range(3):
        terms = []
        for b in range(batch):
            for t in range(length - 1):
                if t + k + 2 < length and mask[b, t + k + 2]:
                    p = torch.softmax(target_logits[b, t + k + 1], -1)
                    q = torch.softmax(steps[k][b, t], -1)
                    terms.append(float((p * (p / q).log()).sum()))
        assert float(losses[k]) == pytest.approx(sum(terms) / len(terms), rel=1e-5)


@pytest.mark.parametrize("eta", [0.0, 3.0, 50.0])
def test_lk_loss_against_loops(eta):
    """LK-lambda per position: exp(-eta a) KL + (1 - exp(-eta a)) (1 - a), a = sum min(p, q); eta 0 is plain KL."""
    torch.manual_seed(2)
    batch, length, vocab = 2, 6, 5
    steps = tuple(torch.randn(batch, length - 1, vocab, requires_grad=True) for _ in range(2))
    target_logits = torch.randn(batch, length, vocab)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    counted = tuple(logits[step_mask(mask, k, length - 1)] for k, logits in enumerate(steps))
    losses = distillation_losses(counted, target_logits, mask, lk_eta=eta)
    for k in range(2):
        terms = []
        for b in range(batch):
            for t in range(length - 1):
                if t + k + 2 < length and mask[b, t + k + 2]:
                    p = torch.softmax(target_logits[b, t + k + 1], -1)
                    q = torch.softmax(steps[k][b, t].detach(), -1)
                    a = float(torch.minimum(p, q).sum())
                    w = math.exp(-eta * a)
                    terms.append(w * float((p * (p / q).log()).sum()) + (1 - w) * (1 - a))
        assert float(losses[k]) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    losses.sum().backward()  # alpha's weight is not differentiated, alpha itself is
    assert all(torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0 for s in steps)


def test_acceptance_objective_against_direct_computation():
    torch.manual_seed(1)
    batch, length, vocab = 2, 6, 7
    draft_ids = torch.tensor([0, 2, 3, 6])
    steps = tuple(torch.randn(batch, length - 1, 4) for _ in range(3))
    target_logits = torch.randn(batch, length, vocab)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1]])
    loss, per_step = acceptance_loss(steps, target_logits, draft_ids, mask)
    def alpha(b, t, k):
        p = torch.softmax(target_logits[b, t + k + 1], -1)
        q = torch.zeros(vocab)
        q[draft_ids] = torch.softmax(steps[k][b, t], -1)
        return float(torch.minimum(p, q).sum())

    def counts(b, t, k):  # step k at position t predicts x[t+k+2]
        return t + k + 2 < length and bool(mask[b, t + k + 2])

    totals = []
    for b in range(batch):
        for t in range(length - 1):
            if counts(b, t, 0):
                total, product = 0.0, 1.0
                for k in range(3):
                    if not counts(b, t, k):
                        break  # the chain ends at its first step without a target
                    product *= alpha(b, t, k)
                    total += product
                totals.append(total)
    assert float(loss) == pytest.approx(-sum(totals) / len(totals), rel=1e-5)
    for k in range(3):  # the mean alpha of each step, over that step's counted predictions
        alphas = [alpha(b, t, k) for b in range(batch) for t in range(length - 1) if counts(b, t, k)]
        assert float(per_step[k]) == pytest.approx(sum(alphas) / len(alphas), rel=1e-5)


def test_draft_vocab_from_hand_counts():
    sequences = [
        TrainingSequence([9, 9, 4, 4, 4, 7], [0, 0, 1, 1, 1, 1]),  # the prompt's 9s do not count
        TrainingSequence([5, 7, 7, 2, 2], [0, 1, 1, 1, 1]),
    ]
    counts = token_counts(sequences, 10)
    assert counts.tolist() == [0, 0, 2, 0, 3, 0, 0, 3, 0, 0]
    d2t, t2d = build_draft_vocab(counts, 3)  # 4 and 7 (3 each), then 2; ascending target ids
    assert (torch.arange(3) + d2t).tolist() == [2, 4, 7]
    assert t2d.nonzero().flatten().tolist() == [2, 4, 7]
    d2t, _ = build_draft_vocab(counts, 4)  # a tie among the unseen tokens goes to the lowest id
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 4, 7]


def test_fit_length_cuts_and_drops():
    sequences = [TrainingSequence([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), TrainingSequence([1, 2, 3], [0, 0, 1])]
    assert fit_length(sequences, 3) == [TrainingSequence([1, 2, 3], [0, 0, 1])]


# --- training runs --------------------------------------------------------------------------------


def test_loss_decreases(trained):
    with open(trained[1] / "train_log.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_trained_drafter_beats_untrained_on_held_out_answers(target, distilled, trained):
    held_out = distilled[1]
    after = evaluate_acceptance(trained[0], target, held_out, depth=3)
    before = evaluate_acceptance(make_drafter(target), target, held_out, depth=3)
    print("held-out acceptance per depth, untrained / trained:", before.acceptance, after.acceptance)
    # a random tiny target is hard to emulate from 32 answers: the clear signal is the expected accepted length
    assert after.expected_length > 1.5 * before.expected_length
    assert after.acceptance[0] > before.acceptance[0]


def test_saved_drafter_loads_without_embedding(target, trained):
    drafter, out = trained
    loaded = Eagle3DraftModel.from_pretrained(out)
    assert loaded.embed_tokens is None and loaded.config.fc_norm and loaded.config.norm_output
    loaded.set_target_embedding(target.get_input_embeddings())
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)
    assert json.loads((out / "training_args.json").read_text())["optimizer_steps"] == 30
    assert (out / "README.md").exists()


def test_acceptance_stage_raises_expected_accepted_length(target, distilled, trained, tmp_path):
    train_sequences = distilled[0][:16]
    before = evaluate_acceptance(trained[0], target, train_sequences, depth=3)
    tuned = train_drafter(target, records(train_sequences), tmp_path, drafter=copy.deepcopy(trained[0]), steps=0,
                          acceptance_steps=6, **FAST)
    after = evaluate_acceptance(tuned, target, train_sequences, depth=3)
    print("expected acceptance per depth before/after:", before.expected, after.expected)
    assert after.expected_length > before.expected_length
    assert all(a > b for a, b in zip(after.expected, before.expected))


def test_draft_vocab_training_restricts_the_head(target, distilled, tmp_path):
    drafter = train_drafter(target, records(distilled[0]), tmp_path, steps=2, draft_vocab_size=40, **FAST)
    counts = token_counts(distilled[0], 256)
    expected = torch.argsort(-counts, stable=True)[:40].sort().values
    assert drafter.lm_head.weight.shape[0] == 40
    assert torch.equal(drafter.draft_to_target(torch.arange(40)), expected)


def test_widened_vocabulary_keeps_the_drafter_and_adds_the_most_frequent_tokens(target, distilled, tmp_path):
    small = train_drafter(target, records(distilled[0]), tmp_path / "small", steps=2, draft_vocab_size=40, **FAST)
    counts = token_counts(distilled[1], 256)  # other answers than the vocabulary was chosen on
    own = small.draft_to_target(torch.arange(40)).tolist()
    added = [i for i in torch.argsort(-counts, stable=True).tolist() if i not in own][:20]
    wide = copy.deepcopy(small)
    widen_draft_vocab(wide, target, counts, 60)
    ids = wide.draft_to_target(torch.arange(60))
    assert ids.tolist() == sorted(own + added) and wide.t2d.nonzero().flatten().tolist() == sorted(own + added)
    features = torch.randn(2, 5, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same drafter: its tokens' logits unchanged, the new rows the target's head rows
        before, after = small(tokens, features).logits, wide(tokens, features).logits
    torch.testing.assert_close(after[..., torch.searchsorted(ids, torch.tensor(own))], before)
    # a new row: the target's row through the least-squares map from the target's rows to the drafter's trained ones
    target_rows, new_rows = target.lm_head.weight.detach(), torch.isin(ids, torch.tensor(added))
    linear_map = torch.linalg.pinv(target_rows[own].double()) @ small.lm_head.weight.detach().double()
    torch.testing.assert_close(wide.lm_head.weight[new_rows].double(), target_rows[ids[new_rows]].double() @ linear_map,
                               rtol=1e-4, atol=1e-5)
    continued = train_drafter(target, records(distilled[0]), tmp_path / "wide", drafter=copy.deepcopy(small),
                              steps=1, draft_vocab_size=60, **FAST)
    assert Eagle3DraftModel.from_pretrained(tmp_path / "wide").lm_head.weight.shape[0] == 60
    frequent = [i for i in torch.argsort(-token_counts(distilled[0], 256), stable=True).tolist() if i not in own][:20]
    assert continued.draft_to_target(torch.arange(60)).tolist() == sorted(own + frequent)
    with pytest.raises(ValueError, match="grow, not shrink"):
        train_drafter(target, records(distilled[0]), tmp_path / "shrunk", drafter=wide, steps=1, draft_vocab_size=50,
                      **FAST)


def test_feature_cache_trains_like_online_features(target, distilled, tmp_path):
    data = records(distilled[0][:16])
    online = train_drafter(target, data, tmp_path / "online", steps=3, **FAST)
    cached = train_drafter(target, data, tmp_path / "cached", steps=3, feature_cache=str(tmp_path / "cache"), **FAST)
    assert (tmp_path / "cache" / "index.json").exists()
    for name, value in weights(online).items():
        torch.testing.assert_close(weights(cached)[name], value, rtol=1e-4, atol=1e-5)


def test_feature_cache_computes_only_what_it_lacks(target, distilled, tmp_path, monkeypatch):
    """Data grown at the end reuses the shards already built; every item equals a fresh build's."""
    from hf_eagle31.training import feature_cache

    sequences, layer_ids = distilled[0][:7], [1, 2, 3]
    feature_cache.build_feature_cache(target, sequences[:4], layer_ids, tmp_path / "grown", 2, shard_size=2)
    real, calls = feature_cache.target_states, []
    monkeypatch.setattr(feature_cache, "target_states", lambda *a: calls.append(1) or real(*a))
    grown = feature_cache.build_feature_cache(target, sequences, layer_ids, tmp_path / "grown", 2, shard_size=2)
    assert len(calls) == 2  # the last two shards: sequences 4-5 and 6
    fresh = feature_cache.build_feature_cache(target, sequences, layer_ids, tmp_path / "fresh", 7, shard_size=64)
    assert len(grown) == len(fresh) == 7
    for i in range(7):
        for name, value in fresh[i].items():
            torch.testing.assert_close(grown[i][name], value, rtol=1e-5, atol=1e-5)
        assert grown[i]["input_ids"].tolist() == sequences[i].input_ids


def test_resume_after_interruption_continues_from_saved_step(target, distilled, tmp_path, monkeypatch):
    """An interrupted run resumed from its checkpoint ends with exactly the weights of an uninterrupted one."""
    data = records(distilled[0][:12])
    settings = dict(steps=4, lr=3e-3, batch_size=4, grad_accum=2, save_every=2, ttt_steps=2, tune_prompts=0)
    reference = train_drafter(target, data, tmp_path / "straight", **settings)

    import hf_eagle31.training.trainer as trainer

    real_step, calls = trainer.training_step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:  # dies in step 3, after the checkpoint of step 2 and half of step 3
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "training_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, data, tmp_path / "resumed", **settings)
    monkeypatch.setattr(trainer, "training_step", real_step)
    saved = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert saved == ["step_00000002"]
    with pytest.raises(ValueError, match="checkpoints of an earlier run"):
        train_drafter(target, data, tmp_path / "resumed", **settings)  # a fresh run would mix with the old one
    resumed = train_drafter(target, data, tmp_path / "resumed", resume=True, **settings)
    for name, value in weights(reference).items():
        torch.testing.assert_close(weights(resumed)[name], value)
    with open(tmp_path / "resumed" / "train_log.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [1, 2, 3, 4]


# --- bad input ------------------------------------------------------------------------------------


def test_mismatched_drafter_is_refused(target, distilled, tmp_path):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="vocabulary"):
        train_drafter(target, records(distilled[0]), tmp_path, drafter=make_drafter(other), steps=1, **FAST)
    wide = make_drafter(target, target_hidden_size=96)
    with pytest.raises(ValueError, match="hidden size"):
        train_drafter(target, records(distilled[0]), tmp_path, drafter=wide, steps=1, **FAST)


def test_empty_data_is_refused(target, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        train_drafter(target, tmp_path / "empty.jsonl", tmp_path / "out", tokenizer=make_tokenizer(), steps=1)
    with pytest.raises(ValueError, match="empty"):
        train_drafter(target, [], tmp_path / "out", tokenizer=make_tokenizer(), steps=1)


def test_prompts_longer_than_context_are_left_out_with_a_warning(tmp_path):
    short = make_target()
    short.config.max_position_embeddings = 40
    data = [{"question_id": 7, "turns": ["abc"]}, {"question_id": 8, "turns": ["a" * 60]}]
    with pytest.warns(UserWarning, match="1 of 2 conversations were left out"):
        train_drafter(short, data, tmp_path, tokenizer=make_tokenizer(), steps=1, tune_prompts=0)
    with pytest.raises(ValueError, match="empty"):
        train_drafter(short, data[1:], tmp_path / "none", tokenizer=make_tokenizer(), steps=1, tune_prompts=0)


def test_unreadable_checkpoint_is_refused_before_generation(target, tmp_path, monkeypatch):
    import hf_eagle31.training.trainer as trainer

    monkeypatch.setattr(trainer, "distill_to_folder", lambda *a, **k: pytest.fail("generated before checking"))
    folder = tmp_path / "checkpoints" / "step_00000004"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    (folder / "trainer_state.json").write_text('{"step": 4}')
    data = [{"turns": ["abc"]}]
    with pytest.raises(ValueError, match="checkpoint .*step_00000004 is unreadable"):
        train_drafter(target, data, tmp_path, tokenizer=make_tokenizer(), steps=8, resume=True)


def test_bad_settings_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="ttt_steps"):
        train_drafter(target, [{"text": "abc"}], tmp_path, tokenizer=make_tokenizer(), steps=1, ttt_steps=9)
    with pytest.raises(ValueError, match="exactly one of steps and epochs"):
        train_drafter(target, [{"text": "abc"}], tmp_path, tokenizer=make_tokenizer())
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        train_drafter(target, [{"input_ids": [1, 2, 3, 999]}], tmp_path, steps=1)
    with pytest.raises(ValueError, match="answers must be 'target'"):
        train_drafter(target, [{"text": "abc"}], tmp_path, tokenizer=make_tokenizer(), steps=1, answers="records")


def test_given_answers_train_on_the_records_own_answers_without_generating(target, tmp_path, monkeypatch):
    from hf_eagle31.training.distill import load_distilled

    tokenizer = make_tokenizer()
    words = ["hello", "world", "drafts", "tokens"]
    records = [{"conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": f"the answer is {w}"}]}
               for w in words]
    monkeypatch.setattr(target, "generate", lambda *a, **k: pytest.fail("given answers generate nothing"))
    train_drafter(target, records, tmp_path, tokenizer=tokenizer, steps=1, answers="given", **FAST)
    assert json.loads((tmp_path / "training_args.json").read_text())["answers"] == "given"
    answered, _ = load_distilled(tmp_path / "distilled")
    for w, sequence in zip(words, answered):
        answer = [i for i, m in zip(sequence.input_ids, sequence.loss_mask) if m]
        assert answer == tokenizer(f"the answer is {w}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


# --- the command ----------------------------------------------------------------------------------


def test_train_command_end_to_end(tmp_path, capsys):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": "x"},
                                                 {"from": "human", "value": "again"}]}
                for i, w in enumerate(["hello", "world", "drafts", "tokens", "target", "answer"])]
    prompts.write_text(json.dumps(sharegpt))
    out = tmp_path / "drafter"
    argv = ["train", "--target", str(tmp_path / "target"), "--data", str(prompts), "--out", str(out), "--arch", "eagle3",
            "--steps", "3", "--batch-size", "4", "--answer-max-new-tokens", "8", "--draft-vocab-size", "8", "--lr", "1e-3",
            "--tune-prompts", "2"]
    assert cli_main(argv) == 0
    drafter = Eagle3DraftModel.from_pretrained(out)
    assert drafter.config.draft_vocab_size == 8 and not drafter.config.fc_norm
    assert {"README.md", "train_log.csv", "distilled", "tuning.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "training_args.json").read_text())["sequences"] == 4  # 6 conversations, 2 held out
    assert cli_main(["train", "--target", str(tmp_path / "missing"), "--data", str(prompts), "--out", str(out),
                     "--steps", "1"]) == 2
    assert f"no such folder: {tmp_path / 'missing'}" in capsys.readouterr().err
