"""One verify forward over a draft tree against the reference it stands for: one-token decoding of each path.

"exact" must reproduce the decoding logits bit for bit (in fp32 and bf16, where batched kernels
round differently from one-row ones); "batched" must agree up to rounding, which catches any mask
or position mistake (those change logits by far more than rounding does).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_models import PROMPTS, make_target, verify_logits
from transformers import DynamicCache

from hf_eagle31.decoding import _block
from hf_eagle31.drafting import DraftTree
from hf_eagle31.generation import eagle_verification
from hf_eagle31.verification import tree_attention_forward
from hf_eagle31.verify_plan import VerifyPlan

#      0
#    1   2
#  3  4    5
#  6
TREE = DraftTree(torch.tensor([7, 11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]),
                 torch.tensor([0, 1, 1, 2, 2, 2, 3]))
CHAIN = DraftTree(torch.tensor([7, 11, 13, 16, 9]), torch.tensor([-1, 0, 1, 2, 3]), torch.tensor([0, 1, 2, 3, 4]))


def path(tree: DraftTree, node: int) -> list[int]:
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = int(tree.parents[node])
    return nodes[::-1]


@torch.no_grad()
def decoded_logits(target, prompt_cache: DynamicCache, tree: DraftTree, node: int) -> torch.Tensor:
    """The logits plain decoding computes after the node's path, one token per forward."""
    cache = copy.deepcopy(prompt_cache)
    for step in path(tree, node):
        logits = target(tree.tokens[step].view(1, 1), past_key_values=cache).logits
    return logits[0, -1].float()


@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_logits_against_one_token_decoding(arch, dtype, tree):
    target = make_target(arch, dtype=dtype)
    prompt = PROMPTS[2:3]
    with torch.no_grad():
        prompt_cache = DynamicCache(config=target.config)
        target(prompt, past_key_values=prompt_cache)
    expected = torch.stack([decoded_logits(target, prompt_cache, tree, node) for node in range(len(tree))])
    mask, positions = tree.ancestor_mask(), prompt.shape[1] + tree.depths
    with eagle_verification(target):
        got = {mode: verify_logits(target, copy.deepcopy(prompt_cache), tree.tokens, positions, mask, [1, 2, 3], mode)
               for mode in ("exact", "batched")}
    assert torch.equal(got["exact"], expected)
    tolerance = 1e-4 if dtype == torch.float32 else 0.25
    torch.testing.assert_close(got["batched"], expected, atol=tolerance, rtol=0.02)
    wrong_mask = torch.ones_like(mask).tril()  # level order seen as a chain: every node sees its siblings
    if not torch.equal(wrong_mask, mask):
        with eagle_verification(target):
            wrong = verify_logits(target, copy.deepcopy(prompt_cache), tree.tokens, positions, wrong_mask, [1, 2, 3])
        assert (wrong - expected).abs().max() > 10 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plans_additive_mask_gives_sdpa_what_its_boolean_mask_gives(dtype):
    plan = VerifyPlan(torch.stack([TREE.ancestor_mask(), torch.ones(7, 7, dtype=torch.bool).tril()]),
                      key_padding=torch.tensor([[False, True, True, True, True], [True] * 5]))
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, n, 8, generator=g).to(dtype) for n in (7, 12, 12))
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=plan.layer_mask(12)[:, None])
    got = F.scaled_dot_product_attention(query, key, value, attn_mask=plan.additive_layer_mask(12, None, dtype))
    assert torch.equal(got, expected)
    assert plan.additive_layer_mask(12, None, dtype) is plan.additive_layer_mask(12, None, dtype)  # converted once per plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 3])
def test_batched_verify_attention_folds_query_heads_without_changing_a_bit(dtype, groups):
    """The query heads sharing a key/value head run as one longer block: SDPA's own grouped attention's result (the
    same products, bit for bit on the 2-core CPU; a wrong grouping or mask would be far off)."""
    plan = VerifyPlan(torch.stack([TREE.ancestor_mask(), torch.ones(7, 7, dtype=torch.bool).tril()]),
                      key_padding=torch.tensor([[False, True, True, True, True], [True] * 5]))
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 7, 2 * groups, 8, generator=g).to(dtype).transpose(1, 2)  # as a projection's view
    key, value = (torch.randn(2, 2, 12, size, generator=g).to(dtype) for size in (8, 6))  # values of another size
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=plan.layer_mask(12)[:, None],
                                              enable_gqa=groups > 1).transpose(1, 2)
    got, _ = tree_attention_forward(torch.nn.Module(), query, key, value, None, eagle_verify_plan=plan)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_a_verify_block_holds_its_chunks_nodes_padded_to_the_width_and_a_whole_tree_as_it_is():
    """`_block` takes one row's whole unpadded tree as it is; any other block (a chunk, padded to a fixed width that
    equals the tree's size, as a compiled verify pads it) gathers its own nodes, then pads."""
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    ancestors = [tree.ancestor_mask()]
    tokens, positions, mask = _block([tree], ancestors, [torch.arange(4)], [10], pad=0)
    assert tokens.tolist() == [[5, 6, 7, 8]] and positions.tolist() == [[10, 11, 11, 12]]
    assert torch.equal(mask[0], ancestors[0])
    tokens, positions, mask = _block([tree], ancestors, [torch.tensor([0, 1])], [10], pad=0, width=4)
    assert tokens.tolist() == [[5, 6, 0, 0]] and positions.tolist() == [[10, 11, 10, 10]]
    assert torch.equal(mask[0], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]).bool())

