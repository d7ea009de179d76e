"""EAGLE decoding: the one loop behind `target.generate(..., assistant_model=drafter)`.

A batch of B prompts (B = 1 included), left-padded and ragged. Each step every row drafts a tree
(drafting.py: one drafter forward per level for the whole batch; a chain is a tree of top-k 1),
one target forward verifies every row's tree (verification.py), and each row walks its own tree
with the acceptance walk, emitting each token exactly as plain `generate` picks it for that row
(its processors, its sampling, its stopping criteria): rows accept different numbers of tokens.
With `verify_chunk_depth` a tree is verified in depth-ordered chunks: a row's next chunk, rooted at
its accepted child, runs only if its walk reaches it.

The target's cache stays rectangular without moving anything already cached: a step keeps, per
row, the entries of the tokens that row accepted, packed at the start of the step's block, and the
block is cut to the longest of them. The shorter rows' surplus entries stay in the cache as holes
that the verify plan hides from every later query, and positions count each row's real tokens, so
a row sees exactly what it would see alone. A row that stops leaves the batch (its cache rows are
dropped); the output is padded as plain `generate` pads it. A single row never leaves holes: its
cache is returned, ready to continue the conversation.

Sliding-window layers index their window over cache entries, which holes would shift: such
targets decode batched prompts one at a time, refused by name here.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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

from hf_eagle31 import llama_verify
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.control import CollapseMonitor, LengthController, draft_depth
from hf_eagle31.drafting import DrafterState, DraftTree, draft_tree
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.verification import (
    UnsupportedTargetError,
    VerifyPlan,
    accept_or_resample,
    children_by_token,
    compact_cache,
    has_sliding_window,
    pick_token,
    static_capacity,
    subtree,
    verify_forward,
    walk,
)


@dataclass
class Speculation:
    """How one call drafts and verifies (generation.py reads it from the drafter's generation config)."""

    mode: str  # "chain" or "tree", for the stats
    top_k: int  # 1: a chain
    total_tokens: int  # draft nodes kept per tree
    controller: LengthController  # the draft depth
    monitor: CollapseMonitor  # whether drafting pays
    chunk_depth: int | None  # levels per verify forward, None: the whole tree
    verify_mode: str  # VerifyPlan's mode
    compiled: Callable | None = None  # the target's compiled call (static cache, compile_config)
    block_size: int = 0  # with `compiled`: every verify block padded to this many tokens, one graph per call
    lean: llama_verify.CacheRoom | None = None  # the target's verify forwards skip transformers' module dispatch


@dataclass
class Row:
    """One prompt of the batch while it decodes."""

    index: int  # in the caller's batch
    processors: LogitsProcessorList  # the row's view of them (`row_processors`)
    sequence: torch.Tensor  # [1, L]: the prompt with its pads, then every emitted token
    position: int  # position id of the next token (pads take none)
    stats: SpeculationStats
    stopped: bool = False


@dataclass
class RowStep:
    """What one row did in one step: the walked nodes (the root first), the emitted tokens, the forwards."""

    nodes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    forwards: int = 0
    next_root: int | None = 0  # the node the next chunk starts from, None when the walk is over


def check_batch(target: PreTrainedModel, batch_size: int, generation_config: GenerationConfig, streamer) -> None:
    """Refuse, by name and before any work, what EAGLE decoding cannot do for more than one prompt."""
    if batch_size == 1:
        return
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


def _block(trees: list[DraftTree], ancestors: list[torch.Tensor], blocks: list[torch.Tensor], roots: list[int],
           pad: int, width: int = 0):
    """A verify forward's input: tokens and positions `[B, n]` and the ancestor masks `[B, n, n]` of each row's
    `blocks` nodes, `n` the largest block or `width` (a row with fewer nodes is padded with nodes that see only
    themselves)."""
    n = max(width, *(block.shape[0] for block in blocks))
    device = trees[0].tokens.device
    tokens = torch.full((len(trees), n), pad, dtype=torch.long, device=device)
    positions = torch.zeros(len(trees), n, dtype=torch.long, device=device)
    mask = torch.eye(n, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    for b, (tree, block, root) in enumerate(zip(trees, blocks, roots)):
        size = block.shape[0]
        tokens[b, :size] = tree.tokens[block]
        positions[b] = root
        positions[b, :size] += tree.depths[block]
        mask[b, :size, :size] = ancestors[b][block][:, block]
    return tokens, positions, mask


def draft_room(cache: Cache) -> int:
    """How many draft nodes still fit after the root: a static cache holds `static_capacity` tokens, a dynamic one
    grows."""
    capacity = static_capacity(cache)
    return 1 << 30 if capacity is None else capacity - int(cache.get_seq_length()) - 1


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
def eagle_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config: GenerationConfig,
    drafter: Eagle3DraftModel,
    speculation: Speculation,
    streamer=None,
    **model_kwargs,
):
    """Decode every row of `input_ids` with EAGLE drafts; the output equals plain `generate`'s, row for row.

    Runs inside `eagle_verification(model)` (the `generate` routing takes care of it).
    """
    batch_size = input_ids.shape[0]
    check_batch(model, batch_size, generation_config, streamer)
    layer_ids = drafter.config.target_layer_ids
    cache = model_kwargs[CACHE_KWARG]
    do_sample = bool(generation_config.do_sample)
    stats = SpeculationStats(mode=speculation.mode)
    drafter.speculation_stats = stats
    returns = generation_config.return_dict_in_generate
    scores_out = [] if returns and generation_config.output_scores else None
    logits_out = [] if returns and generation_config.output_logits else None
    pad = int(generation_config._pad_token_tensor) if generation_config._pad_token_tensor is not None else 0

    def emit(row: Row, logits: torch.Tensor, proposal: tuple[int, torch.Tensor] | None = None) -> tuple[int, bool]:
        """Pick the row's next token from its raw logits `[V]` as plain `generate` does (a sampled chain's drafted
        token is accepted against its `proposal`, which draws from the same distribution), and record it."""
        scores = row.processors(row.sequence, logits[None])
        token = pick_token(scores, do_sample) if proposal is None else accept_or_resample(scores, *proposal)
        row.sequence = torch.cat([row.sequence, token.to(row.sequence.device)], dim=1)
        row.position += 1
        if scores_out is not None:
            scores_out.append(scores)
        if logits_out is not None:
            logits_out.append(logits[None])
        return int(token), bool(stopping_criteria(row.sequence, scores).any())

    start = int(cache.get_seq_length())
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    key_mask = attention_mask.bool()  # [B, cached]: False for a pad, later also for a hole
    prompt_positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~key_mask, 0)
    out = model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=prompt_positions[:, start:],
                use_cache=True, **{CACHE_KWARG: cache}, output_hidden_states=capture_request(layer_ids), logits_to_keep=1)
    features = select_features(out.hidden_states, layer_ids)
    rows, state = [], DrafterState(drafter, batch_size)
    for b in range(batch_size):
        row = Row(b, row_processors(logits_processor, b), input_ids[b : b + 1], int(key_mask[b].sum()),
                  SpeculationStats(mode=speculation.mode))
        token, row.stopped = emit(row, out.logits[b, -1].float())
        real = key_mask[b, start:]
        state.push(features[b : b + 1, real.to(features.device)], row.sequence[:, start + 1 :][:, real], b)
        rows.append(row)
    if batch_size > 1:
        stats.per_row = [row.stats for row in rows]
    streamed = _stream(streamer, rows, input_ids.shape[1])
    finished: list[Row] = []
    rows, key_mask = _leave(rows, finished, cache, state, key_mask)

    def verify(trees: list[DraftTree]) -> list[RowStep]:
        """Verify every row's tree, chunk by chunk, and walk it; the cache keeps the walked nodes, the drafter is fed."""
        nonlocal key_mask
        ancestors = [tree.ancestor_mask() for tree in trees]
        children = [children_by_token(tree) for tree in trees]
        roots = [row.position - 1 for row in rows]  # each tree root's position
        steps = [RowStep() for _ in rows]
        empty = torch.zeros(0, dtype=torch.long, device=trees[0].tokens.device)
        while any(step.next_root is not None for step in steps):
            blocks = [empty if step.next_root is None else subtree(tree, step.next_root, speculation.chunk_depth)
                      for tree, step in zip(trees, steps)]
            fixed = speculation.compiled is not None and speculation.block_size - 1 <= draft_room(cache)
            tokens, positions, mask = _block(trees, ancestors, blocks, roots, pad, speculation.block_size if fixed else 0)
            plan = VerifyPlan.for_cache(mask, cache, speculation.verify_mode, key_mask, input_ids.shape[1], batch_size)
            logits, block_features = verify_forward(model, cache, plan, tokens, positions, layer_ids,
                                                    speculation.compiled if fixed else None, speculation.lean)
            kept = []
            for b, (row, block, step) in enumerate(zip(rows, blocks, steps)):
                if step.next_root is None:
                    kept.append(empty)
                    continue
                local = {node: i for i, node in enumerate(block.tolist())}
                chunk = walk(children[b], step.next_root, lambda node, b=b, row=row, local=local:
                             emit(row, logits[b, local[node]], trees[b].proposal(node)), local)
                keep = torch.tensor([local[node] for node in chunk.nodes], device=empty.device)
                kept.append(keep)
                if not chunk.stopped:
                    state.push(block_features[b : b + 1, keep], torch.tensor([chunk.tokens], device=empty.device), b)
                row.stopped, step.next_root = chunk.stopped, chunk.next_root
                step.nodes += chunk.nodes
                step.tokens += chunk.tokens
                step.forwards += 1
            key_mask = torch.cat([key_mask, compact_cache(cache, plan.cached, kept).to(key_mask.device)], dim=1)
        return steps

    controller, monitor = speculation.controller, speculation.monitor
    while rows:
        began = time.perf_counter()
        room = draft_room(cache)
        depth = min(draft_depth(controller.length, max(row.sequence.shape[1] for row in rows),
                                generation_config.max_length), room)
        speculate = monitor.should_speculate()
        roots = torch.cat([row.sequence[0, -1:] for row in rows])
        if speculate and depth > 0:
            trees = draft_tree(state, roots, depth, speculation.top_k, min(speculation.total_tokens, room),
                               float(generation_config.temperature or 1.0) if do_sample else None)
        else:
            trees = [DraftTree.root_only(root) for root in roots]
        drafted = time.perf_counter()
        steps = verify(trees)
        done = time.perf_counter()
        if speculate:
            for row, tree, step in zip(rows, trees, steps):
                path = step.nodes[1:]
                for record in (stats,) if batch_size == 1 else (row.stats, stats):
                    record.record_step(tree.depth, len(path), len(step.tokens), step.forwards, tree.ranks[path].tolist(),
                                       tree.frontier_ranks.tolist())
            stats.draft_seconds += drafted - began
            stats.verify_seconds += done - drafted
            accepted = [len(step.nodes) - 1 for step in steps]
            controller.update(max(tree.depth for tree in trees), round(sum(accepted) / len(accepted)))
            monitor.record_speculative(sum(len(step.tokens) for step in steps) / len(rows), done - began,
                                       done - drafted)
            stats.fallbacks = monitor.fallbacks
        else:
            stats.plain_steps += 1
            stats.plain_seconds += done - began
            monitor.record_plain(done - began)
        streamed = _stream(streamer, rows, streamed)
        rows, key_mask = _leave(rows, finished, cache, state, key_mask)

    if streamer is not None:
        streamer.end()
    finished.sort(key=lambda row: row.index)
    length = max(row.sequence.shape[1] for row in finished)
    sequences = torch.full((batch_size, length), pad, dtype=input_ids.dtype, device=input_ids.device)
    for row in finished:
        sequences[row.index, : row.sequence.shape[1]] = row.sequence[0]
    if not returns:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores_out) if scores_out is not None else None,
        logits=tuple(logits_out) if logits_out is not None else None,
        **{CACHE_KWARG: cache if batch_size == 1 else None},  # a batch's cache holds holes and only its last rows
    )


def _stream(streamer, rows: list[Row], streamed: int) -> int:
    """Send a single row's new tokens to the streamer; return how many it has been sent."""
    if streamer is None or not rows:
        return streamed
    sequence = rows[0].sequence
    streamer.put(sequence[:, streamed:].cpu())
    return sequence.shape[1]
