"""With sampling, EAGLE's output distribution is exactly the target's.

The reference is exact, not another sample: the joint probability of the first three generated
tokens under the target's processed distribution (the same warpers `generate` applies), computed by
enumerating the support. EAGLE samples from many seeds are checked against it with a chi-square
goodness-of-fit test at significance 0.001; a negative control shows the test rejects a sampler
whose distribution is slightly off.
"""

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import PROMPTS, trained_pair
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_eagle31 import hold_products

ALPHA = 1e-3
SAMPLES = 2000
TEMPERATURE, TOP_K = 0.9, 12


def exact_joint(target, prompt, temperature, top_k, length=3) -> dict[tuple[int, ...], float]:
    """P(x1..x_length | prompt) under temperature + top-k, by enumerating every supported prefix."""
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    prefixes = {(): 1.0}
    for _ in range(length):
        keys = list(prefixes)
        batch = torch.cat([prompt.expand(len(keys), -1), torch.tensor([list(k) for k in keys], dtype=torch.long).view(len(keys), -1)], 1)
        with torch.no_grad():
            logits = target(batch).logits[:, -1].float()
        probs = torch.softmax(warp(batch, logits), dim=-1)
        prefixes = {
            key + (token,): prefixes[key] * float(probs[row, token])
            for row, key in enumerate(keys)
            for token in probs[row].nonzero().flatten().tolist()
        }
    return prefixes


def sample_counts(target, drafter, inputs: dict, temperature, top_k, **generate_kwargs):
    """Each row's counts of its generated 3-token continuations of `inputs` (`generate`'s arguments), one sample per
    seed, and how many draft tokens were accepted in all."""
    counts: list[dict[tuple[int, ...], int]] = [{} for _ in inputs["input_ids"]]
    accepted = 0
    with hold_products(target), hold_products(drafter):  # packed once, not in each call: 40% less time
        for seed in range(SAMPLES):
            torch.manual_seed(seed)
            out = target.generate(**inputs, do_sample=True, temperature=temperature, top_k=top_k, top_p=None,
                                  max_new_tokens=3, assistant_model=drafter, **generate_kwargs)
            for row, row_counts in enumerate(counts):
                key = tuple(out[row, inputs["input_ids"].shape[1]:].tolist())
                row_counts[key] = row_counts.get(key, 0) + 1
            stats = drafter.speculation_stats
            accepted += stats.speculative_tokens - stats.speculative_forwards
    return counts, accepted


def goodness_of_fit(counts, probabilities) -> float:
    """Chi-square p-value; outcomes with expected count < 5 are pooled into one bin."""
    observed, expected, rest_observed, rest_expected = [], [], 0, 0.0
    total = sum(probabilities.values())  # 1 up to float rounding
    for key, p in probabilities.items():
        p /= total
        if p * SAMPLES >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * SAMPLES)
        else:
            rest_observed += counts.get(key, 0)
            rest_expected += p * SAMPLES
    observed.append(rest_observed + sum(c for k, c in counts.items() if k not in probabilities))
    expected.append(rest_expected)
    assert len(observed) >= 8, "too few bins for a meaningful test"
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module", params=["chain", "tree"])
def eagle_samples(request):
    target, drafter = trained_pair("llama", True, speculation_mode=request.param, collapse_fallback=False)
    prompt = PROMPTS[0:1]
    (counts,), accepted = sample_counts(target, drafter, {"input_ids": prompt}, TEMPERATURE, TOP_K)
    return target, accepted, prompt, counts


def test_sampling_matches_the_target_distribution(eagle_samples):
    target, accepted, prompt, counts = eagle_samples
    assert accepted > SAMPLES // 4, "draft tokens were rarely accepted: the acceptance path went untested"
    p_value = goodness_of_fit(counts, exact_joint(target, prompt, TEMPERATURE, TOP_K))
    assert p_value > ALPHA, f"EAGLE samples do not follow the target distribution (p = {p_value:.2e})"


def test_the_test_rejects_a_wrong_distribution(eagle_samples):
    """Negative control: the same samples against the distribution at a slightly different temperature."""
    target, _, prompt, counts = eagle_samples
    p_value = goodness_of_fit(counts, exact_joint(target, prompt, TEMPERATURE * 1.25, TOP_K))
    assert p_value < ALPHA


def test_a_tree_samples_the_very_tokens_the_target_alone_samples_with_the_same_seed():
    """A tree is drafted greedily, and verification draws each position from the target's processed distribution
    with one `multinomial`, as plain sampling does: so, seed for seed, the same text (a sampler that consumed the
    random stream differently, or sampled from other probabilities, would drift at once)."""
    target, drafter = trained_pair("llama", True, speculation_mode="tree", collapse_fallback=False)
    accepted = 0
    for seed in range(4):
        outputs = []
        for assistant in (None, drafter):
            torch.manual_seed(seed)
            outputs.append(target.generate(PROMPTS[seed : seed + 1], do_sample=True, temperature=TEMPERATURE,
                                           top_k=TOP_K, top_p=None, max_new_tokens=24, assistant_model=assistant))
        stats = drafter.speculation_stats
        accepted += stats.speculative_tokens - stats.speculative_forwards
        assert torch.equal(outputs[0], outputs[1]), f"seed {seed}: the tree sampled other tokens than the target"
    assert accepted > 8, "draft tokens were rarely accepted: the acceptance path went untested"
