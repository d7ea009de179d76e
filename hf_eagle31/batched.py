"""Batched EAGLE decoding: several prompts, left-padded and ragged, through one target forward per step.

Every row drafts its own chain or tree (one drafter forward per level for the batch, see
`DrafterState`); the drafts go through one target forward with a per-row mask; each row walks its
own draft with verification.py's acceptance walk (`walk`), so it accepts its own number of tokens.
The target's cache stays rectangular without moving anything already cached: a step keeps, per
row, the entries of the tokens that row accepted, packed at the start of the step's block, and the
block is cut to the longest of them. The shorter rows' surplus entries stay in the cache as holes
that `key_mask` hides from every later query, and positions count each row's real tokens, so a row
sees exactly what it would see alone. A row that stops leaves the batch (its cache rows are
dropped); the output is padded as plain `generate` pads it.

Sliding-window layers index their window over cache entries, which holes would shift: such
targets decode batched prompts one at a time, refused by name here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_eagle31.control import CollapseMonitor, LengthController, draft_depth
from hf_eagle31.drafting import DrafterState, DraftTree, draft_chain, draft_tree, truncate_cache
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.verification import (
    EAGER_ATTENTION_NAME,
    UnsupportedTargetError,
    additive_mask,
    children_by_token,
    has_sliding_window,
    pick_token,
    walk,
)


@dataclass
class Row:
    """One prompt of the batch while it decodes."""

    index: int  # in the caller's batch
    processors: LogitsProcessorList  # the row's view of them (`row_processors`)
    sequence: torch.Tensor  # [1, L]: the prompt with its pads, then every emitted token
    position: int  # position id of the next token (pads take none)
    stats: SpeculationStats
    stopped: bool = False


def check_batch(target: PreTrainedModel, generation_config: GenerationConfig, streamer) -> None:
    """Refuse, by name and before any work, what batched EAGLE decoding cannot do."""
    if has_sliding_window(target.config.get_text_config()):
        raise UnsupportedTargetError(
            f"batched EAGLE decoding does not support sliding-window attention ({type(target).__name__}): "
            "generate one prompt at a time with this target")
    if streamer is not None:
        raise ValueError("streamers take one sequence, as in transformers: stream with a batch of one prompt")
    if generation_config.return_dict_in_generate and (generation_config.output_scores or generation_config.output_logits):
        raise ValueError("batched EAGLE decoding cannot return per-step scores or logits (rows advance by different "
                         "numbers of tokens); generate one prompt at a time for them")


def row_processors(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors as they apply to one row alone.

    Plain `generate` calls them on the whole batch; rows here advance separately, so each calls them
    on its own sequence. Four keep per-row state: repetition penalty's prompt pad lengths (one per row),
    the encoder repetition penalty's prompts and the encoder n-gram ban's n-grams (one per row), and
    `prefix_allowed_tokens_fn`'s batch id.
    """
    views = []
    for processor in processors:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(processor.prompt_ignore_length,
                                                                                  torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[row : row + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            processor = copy.copy(processor)
            processor.batch_size, processor.generated_ngrams = 1, processor.generated_ngrams[row : row + 1]
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            allowed = processor._prefix_allowed_tokens_fn
            processor._prefix_allowed_tokens_fn = lambda batch_id, sent: allowed(row + batch_id, sent)
        views.append(processor)
    return LogitsProcessorList(views)


def draft(state: DrafterState, rows: list[Row], mode: str, depth: int, top_k: int, total_tokens: int,
          choose) -> list[DraftTree]:
    """Every row's draft from one drafter forward per level: a tree, or a chain of `depth` tokens."""
    roots = torch.cat([row.sequence[0, -1:] for row in rows])
    if mode == "tree":
        return draft_tree(state, roots, depth, top_k, total_tokens)
    tokens, _ = draft_chain(state, depth, choose)
    return [DraftTree.chain(root, chain.to(root.device)) for root, chain in zip(roots, tokens)]


def _block(rows: list[Row], trees: list[DraftTree], key_mask: torch.Tensor, pad: int):
    """The step's input: tokens and positions `[B, n]`, and the `[B, 1, n, cached + n]` bool mask."""
    n = max(len(tree) for tree in trees)
    device = key_mask.device
    tokens = torch.full((len(rows), n), pad, dtype=torch.long, device=device)
    positions = torch.zeros(len(rows), n, dtype=torch.long, device=device)
    tree_mask = torch.eye(n, dtype=torch.bool, device=device).repeat(len(rows), 1, 1)  # a pad node sees itself
    for b, (row, tree) in enumerate(zip(rows, trees)):
        size = len(tree)
        tokens[b, :size] = tree.tokens
        positions[b, :size] = row.position - 1 + tree.depths  # the root is the row's last emitted token
        positions[b, size:] = row.position - 1
        tree_mask[b, :size, :size] = tree.ancestor_mask()
    past = key_mask[:, None, :].expand(-1, n, -1)
    return tokens, positions, torch.cat([past, tree_mask], dim=2)[:, None]


def verify_rows(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every row's block: float logits `[B, n, V]` and the drafter's features."""
    eager = model.config._attn_implementation == EAGER_ATTENTION_NAME  # eager attention adds its mask
    out = model(input_ids=tokens, position_ids=positions, attention_mask=additive_mask(mask, model.dtype) if eager
                else mask, past_key_values=cache, use_cache=True, output_hidden_states=capture_request(layer_ids))
    return out.logits.float(), select_features(out.hidden_states, layer_ids)


def compact_rows(cache: Cache, start: int, kept: list[torch.Tensor]) -> torch.Tensor:
    """Pack each row's kept block entries (`kept[b]`, ascending) at `start`, cut the block to the longest.

    Returns the `[B, longest]` bool mask of the packed entries that are real (the rest are holes).
    """
    longest = max(k.shape[0] for k in kept)
    device = cache.layers[0].keys.device
    index = torch.zeros(len(kept), longest, dtype=torch.long, device=device)
    real = torch.zeros(len(kept), longest, dtype=torch.bool, device=device)
    for b, k in enumerate(kept):
        index[b, : k.shape[0]] = k.to(device)
        real[b, : k.shape[0]] = True
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for entries in (layer.keys, layer.values):  # their head sizes differ in MLA targets (DeepSeek, MiniCPM3)
            block = entries[:, :, start:]
            gather = index[:, None, :, None].expand(-1, block.shape[1], -1, block.shape[3])
            entries[:, :, start : start + longest] = block.gather(2, gather)
    truncate_cache(cache, start + longest)
    return real


def _leave(rows: list[Row], finished: list[Row], cache: Cache, state: DrafterState, key_mask: torch.Tensor):
    """Move the rows that stopped to `finished` and drop their cache rows; return the others and their key mask."""
    keep = [b for b, row in enumerate(rows) if not row.stopped]
    if len(keep) == len(rows):
        return rows, key_mask
    finished += [row for row in rows if row.stopped]
    if keep:
        index = torch.tensor(keep, dtype=torch.long, device=key_mask.device)
        cache.batch_select_indices(index)
        state.select(index)
        key_mask = key_mask[index]
    return [rows[b] for b in keep], key_mask


@torch.no_grad()
def eagle_batched_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    drafter: Eagle3DraftModel,
    mode: str,
    top_k: int,
    total_tokens: int,
    choose: Callable[[torch.Tensor], torch.Tensor],
    controller: LengthController,
    monitor: CollapseMonitor,
    streamer=None,
    **model_kwargs,
):
    """Decode every row of `input_ids` with EAGLE drafts; rows equal plain batched `generate` row for row.

    The speculation settings come from generation.py, read from the drafter's generation config:
    `controller` sets the draft depth (chain length), `choose` picks a chain's draft tokens. Runs
    inside `eagle_verification(model)` (the `generate` routing takes care of it).
    """
    check_batch(model, generation_config, streamer)
    layer_ids = drafter.config.target_layer_ids
    cache = model_kwargs["past_key_values"]
    do_sample = bool(generation_config.do_sample)
    stats = SpeculationStats(mode=mode)
    drafter.speculation_stats = stats
    pad = int(generation_config._pad_token_tensor) if generation_config._pad_token_tensor is not None else 0

    def emit(row: Row, logits: torch.Tensor) -> tuple[int, bool]:
        """Pick the row's next token exactly as plain `generate` does for that row, and record it."""
        scores = row.processors(row.sequence, logits[None])
        token = pick_token(scores, do_sample)
        row.sequence = torch.cat([row.sequence, token.to(row.sequence.device)], dim=1)
        row.position += 1
        return int(token), bool(stopping_criteria(row.sequence, scores).any())

    start = cache.get_seq_length()
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    key_mask = attention_mask.bool()
    prompt_positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~key_mask, 0)
    out = model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=prompt_positions[:, start:],
                past_key_values=cache, use_cache=True, output_hidden_states=capture_request(layer_ids), logits_to_keep=1)
    features = select_features(out.hidden_states, layer_ids)
    rows, state = [], DrafterState(drafter, input_ids.shape[0])
    for b in range(input_ids.shape[0]):
        row = Row(b, row_processors(logits_processor, b), input_ids[b : b + 1], int(key_mask[b].sum()),
                  SpeculationStats(mode=mode))
        token, row.stopped = emit(row, out.logits[b, -1].float())
        real = key_mask[b, start:]
        state.push(features[b : b + 1, real.to(features.device)], row.sequence[:, start + 1 :][:, real], b)
        rows.append(row)
    stats.per_row = [row.stats for row in rows]
    finished: list[Row] = []
    rows, key_mask = _leave(rows, finished, cache, state, key_mask)

    while rows:
        began = time.perf_counter()
        longest = max(row.sequence.shape[1] for row in rows)
        depth = draft_depth(controller.length, longest, generation_config.max_length)
        speculate = monitor.should_speculate()
        if speculate and depth > 0:
            trees = draft(state, rows, mode, depth, top_k, total_tokens, choose)
        else:
            trees = [DraftTree.root_only(row.sequence[0, -1:]) for row in rows]
        drafted = time.perf_counter()
        tokens, positions, mask = _block(rows, trees, key_mask, pad)
        cached = cache.get_seq_length()
        logits, features = verify_rows(model, cache, tokens, positions, mask, layer_ids)
        kept, emitted, accepted = [], 0, []
        for b, (row, tree) in enumerate(zip(rows, trees)):
            walked = walk(children_by_token(tree), 0, lambda node, b=b, row=row: emit(row, logits[b, node]),
                          range(len(tree)))
            row.stopped, path = walked.stopped, walked.nodes[1:]
            nodes = torch.tensor(walked.nodes, device=tokens.device)
            kept.append(nodes)
            if not row.stopped:
                state.push(features[b : b + 1, nodes], torch.tensor([walked.tokens], device=tokens.device), b)
            emitted += len(walked.tokens)
            accepted.append(len(path))
            if speculate:
                for record in (row.stats, stats):
                    record.record_step(tree.depth, len(path), len(walked.tokens), 1, tree.ranks[path].tolist())
        key_mask = torch.cat([key_mask, compact_rows(cache, cached, kept)], dim=1)
        done = time.perf_counter()
        if speculate:
            stats.draft_seconds += drafted - began
            stats.verify_seconds += done - drafted
            controller.update(max(tree.depth for tree in trees), round(sum(accepted) / len(accepted)))
            monitor.record_speculative(emitted / len(rows), done - began, done - drafted)
            stats.fallbacks = monitor.fallbacks
        else:
            stats.plain_steps += 1
            stats.plain_seconds += done - began
            monitor.record_plain(done - began)
        rows, key_mask = _leave(rows, finished, cache, state, key_mask)

    finished.sort(key=lambda row: row.index)
    length = max(row.sequence.shape[1] for row in finished)
    sequences = torch.full((len(finished), length), pad, dtype=input_ids.dtype, device=input_ids.device)
    for row in finished:
        sequences[row.index, : row.sequence.shape[1]] = row.sequence[0]
    if not generation_config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences)  # no cache: it holds holes and only the last rows
