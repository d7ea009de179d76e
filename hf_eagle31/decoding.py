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
from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_eagle31.acceptance import accept_or_resample, children_by_token, pick_token, stopper, walk
from hf_eagle31.cache import compact_cache, draft_budget
from hf_eagle31.compat import CACHE_KWARG
from hf_eagle31.control import CollapseMonitor, DepthController, draft_depth
from hf_eagle31.drafting import DrafterState, DraftTree, draft_tree
from hf_eagle31.features import capture_request, select_features
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.stats import SpeculationStats
from hf_eagle31.verification import UnsupportedTargetError, has_sliding_window, subtree
from hf_eagle31.verify_plan import VerifyPlan

if TYPE_CHECKING:  # the routing hands the loop a backend's `Prepared`; the loop imports no backend
    from hf_eagle31.backends import Prepared


@dataclass(frozen=True)
class Speculation:
    """How one call drafts and verifies, decided once before it starts (generation.py's `speculation_plan`, from the
    drafter's settings and the call) and named as the settings name it. The two state objects change as the call
    decodes; which objects they are does not."""

    mode: str  # "chain", "tree" or "plain" (fast_decoding): `speculation_mode`, for the stats
    tree_top_k: int  # 1: a chain
    tree_total_tokens: int  # draft nodes kept per tree
    controller: DepthController  # the tree depth, moved with acceptance where `dynamic_speculation`
    monitor: CollapseMonitor  # whether drafting pays (`collapse_fallback`)
    verify_chunk_depth: int | None  # levels per verify forward, None: the whole tree
    verify_mode: str  # VerifyPlan's mode
    cpu_backend: bool  # on the CPU backend where it serves the target (hf_eagle31.backends)
    compile_verify: bool  # on the CPU backend, with the compiled lean verify forward
    static_draft: bool  # fixed-shape drafts (`draft_tree`'s `static`), replayed where the backend can
    compiled: Callable | None = None  # the target's compiled call (static cache, compile_config)
    block_size: int = 0  # with `compiled`: every verify block padded to this many tokens, one graph per call


@dataclass
class EagleGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate`'s output with `return_dict_in_generate=True`, with what speculation did in this call."""

    speculation_stats: SpeculationStats | None = None


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
        raise ValueError("batched EAGLE decoding and fast_decoding cannot return per-step scores or logits (rows "
                         "advance by different numbers of tokens, and leave as they stop); generate one prompt at a "
                         "time for them")


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
    themselves). One row verifying its whole tree unpadded (a block holds its nodes in level order) takes it as it
    is: a plain step's fixed cost is a dozen small operations less."""
    n = max(width, *(block.shape[0] for block in blocks))
    if len(trees) == 1 and blocks[0].shape[0] == len(trees[0]) == n:
        tree = trees[0]
        return tree.tokens[None], (tree.depths + roots[0])[None], ancestors[0][None]
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


class EagleLoop:
    """One call's decoding, as named steps: `prefill`, then per step `draft`, `verify` (each row's `walk`),
    `record`, `leave`; then `finish`. It holds the rows still decoding, the target's cache and which of its
    entries each row sees (`key_mask`), the drafter's state and the call's statistics."""

    def __init__(self, model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                 generation_config: GenerationConfig, drafter: Eagle3DraftModel | None, speculation: Speculation,
                 prepared: Prepared, streamer=None, **model_kwargs):
        self.input_ids, self.speculation, self.prepared = input_ids, speculation, prepared
        self.processors, self.stops, self.streamer = logits_processor, stopper(stopping_criteria), streamer
        self.config, self.model_kwargs = generation_config, model_kwargs
        self.batch_size = input_ids.shape[0]
        check_batch(model, self.batch_size, generation_config, streamer)
        self.layer_ids = drafter.config.target_layer_ids if drafter is not None else []
        self.cache = model_kwargs[CACHE_KWARG]
        self.do_sample = bool(generation_config.do_sample)
        self.stats = SpeculationStats(mode=speculation.mode)
        if drafter is not None:
            drafter.speculation_stats = self.stats
        returns = generation_config.return_dict_in_generate
        self.scores_out = [] if returns and generation_config.output_scores else None
        self.logits_out = [] if returns and generation_config.output_logits else None
        pad = generation_config._pad_token_tensor
        self.pad = int(pad) if pad is not None else 0
        self.rows: list[Row] = []
        self.finished: list[Row] = []
        self.state = None
        if drafter is not None:
            drafted = speculation.controller.max_depth * speculation.tree_top_k  # the most draft nodes a step feeds
            capacity = input_ids.shape[1] + 256 + drafted  # grows by doubling
            self.state = DrafterState(drafter, self.batch_size, prepared.draft_products, capacity,
                                      prepared.draft_replay if speculation.static_draft else None,
                                      prepared.draft_forward)
        self.key_mask: torch.Tensor | None = None  # [B, cached]: False for a pad, later also for a hole
        self.padded = self.holed = False  # whether `key_mask` hides a pad, may hide a hole: known without reading it
        self.streamed = input_ids.shape[1]

    def run(self):
        self.prefill()
        while self.rows:
            began = time.perf_counter()
            trees, speculated = self.draft()
            drafted = time.perf_counter()
            steps = self.verify(trees)
            self.record(trees, steps, speculated, began, drafted, time.perf_counter())
            self.leave()
        return self.finish()

    def emit(self, row: Row, logits: torch.Tensor,
             proposal: tuple[int, torch.Tensor] | None = None) -> tuple[int, bool]:
        """Pick the row's next token from its raw logits `[V]` as plain `generate` does (a sampled chain's drafted
        token is accepted against its `proposal`, which draws from the same distribution), and record it."""
        scores = row.processors(row.sequence, logits[None])
        picked = pick_token(scores, self.do_sample, self.prepared.argmax) if proposal is None else \
            accept_or_resample(scores, *proposal)
        row.sequence = torch.cat([row.sequence, picked.to(row.sequence.device)], dim=1)
        row.position += 1
        if self.scores_out is not None:
            self.scores_out.append(scores)
        if self.logits_out is not None:
            self.logits_out.append(logits[None])
        token = int(picked)
        return token, self.stops(row.sequence, token, scores)

    def prefill(self) -> None:
        """The prompts through the target (past what the cache holds); each row emits its first token, and the
        drafter is queued the features of its real positions."""
        input_ids, cache = self.input_ids, self.cache
        start = int(cache.get_seq_length())
        attention_mask = self.model_kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.key_mask = attention_mask.bool()
        self.padded = not bool(self.key_mask.all())
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~self.key_mask, 0)
        out = self.prepared.forward(input_ids=input_ids[:, start:], attention_mask=attention_mask,
                         position_ids=positions[:, start:], use_cache=True, **{CACHE_KWARG: cache},
                         output_hidden_states=capture_request(self.layer_ids), logits_to_keep=1)
        features = select_features(out.hidden_states, self.layer_ids)
        for b in range(self.batch_size):
            row = Row(b, row_processors(self.processors, b), input_ids[b : b + 1], int(self.key_mask[b].sum()),
                      SpeculationStats(mode=self.speculation.mode))
            _, row.stopped = self.emit(row, out.logits[b, -1].float())
            real = self.key_mask[b, start:]
            if self.state is not None:
                self.state.push(features[b : b + 1, real.to(features.device)], row.sequence[:, start + 1 :][:, real],
                                b)
            self.rows.append(row)
        if self.batch_size > 1:
            self.stats.per_row = [row.stats for row in self.rows]
        self.stream()
        self.leave()

    def draft(self) -> tuple[list[DraftTree], bool]:
        """Each row's draft tree (a root alone where drafting does not pay now or the cache takes no draft), and
        whether this step speculates."""
        speculation, budget = self.speculation, draft_budget(self.cache)
        longest = max(row.sequence.shape[1] for row in self.rows)
        tree_depth = min(draft_depth(speculation.controller.tree_depth, longest, self.config.max_length), budget)
        speculate = self.state is not None and speculation.monitor.should_speculate()
        if not (speculate and tree_depth > 0):
            return [DraftTree.root_only(row.sequence[0, -1:]) for row in self.rows], speculate
        roots = torch.cat([row.sequence[0, -1:] for row in self.rows])
        temperature = float(self.config.temperature or 1.0) if self.do_sample else None
        with torch.autocast(roots.device.type, enabled=False):  # the drafter in its own dtype, whatever the user's
            return draft_tree(self.state, roots, tree_depth, speculation.tree_top_k,
                              min(speculation.tree_total_tokens, budget), temperature, speculation.static_draft), True

    def verify(self, trees: list[DraftTree]) -> list[RowStep]:
        """Verify every row's tree, chunk by chunk, and walk it; the cache keeps the walked nodes, the drafter is fed
        their features. `[B]` trees in, what each row did out."""
        speculation, cache = self.speculation, self.cache
        ancestors = [tree.ancestor_mask() for tree in trees]
        children = None  # the walk's, read from the trees once the first forward is under way
        roots = [row.position - 1 for row in self.rows]  # each tree root's position
        steps = [RowStep() for _ in self.rows]
        empty = self.input_ids.new_empty(0)  # a finished row's block
        while any(step.next_root is not None for step in steps):
            blocks = [empty if step.next_root is None else subtree(tree, step.next_root, speculation.verify_chunk_depth)
                      for tree, step in zip(trees, steps)]
            fixed = speculation.compiled is not None and speculation.block_size - 1 <= draft_budget(cache)
            tokens, positions, mask = _block(trees, ancestors, blocks, roots, self.pad,
                                             speculation.block_size if fixed else 0)
            plan = VerifyPlan.for_cache(mask, cache, speculation.verify_mode, self.key_mask, self.input_ids.shape[1],
                                        self.batch_size, (self.padded, self.holed))
            logits, features = self.prepared.verify(cache, plan, tokens, positions,
                                                    speculation.compiled if fixed else None)
            children = children or [children_by_token(tree) for tree in trees]
            kept = [empty if step.next_root is None else
                    self.walk(b, trees[b], children[b], step, block, logits[b],
                              None if features is None else features[b : b + 1])
                    for b, (step, block) in enumerate(zip(steps, blocks))]
            real = compact_cache(cache, plan.cached, kept, self.prepared.truncate).to(self.key_mask.device)
            self.key_mask = torch.cat([self.key_mask, real], dim=1)
            self.holed = self.holed or len({k.shape[0] for k in kept}) > 1
        return steps

    def walk(self, b: int, tree: DraftTree, children: list[dict[int, int]], step: RowStep, block: torch.Tensor,
             logits: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Row `b`'s acceptance walk over the verified `block` of its tree (`logits` `[n, V]`, `features`
        `[1, n, 3 H_t]`); returns the indices in the block of the walked nodes, whose cache entries stay."""
        row = self.rows[b]
        local = {node: i for i, node in enumerate(block.tolist())}
        chunk = walk(children, step.next_root, lambda node: self.emit(row, logits[local[node]], tree.proposal(node)),
                     local)
        keep = torch.tensor([local[node] for node in chunk.nodes], device=tree.tokens.device)
        if not chunk.stopped and self.state is not None:
            self.state.push(features[:, keep], torch.tensor([chunk.tokens], device=tree.tokens.device), b)
        row.stopped, step.next_root = chunk.stopped, chunk.next_root
        step.nodes += chunk.nodes
        step.tokens += chunk.tokens
        step.forwards += 1
        return keep

    def record(self, trees: list[DraftTree], steps: list[RowStep], speculated: bool, began: float, drafted: float,
               done: float) -> None:
        """The step into the statistics, the depth controller and the collapse monitor; new tokens to the streamer."""
        stats, monitor = self.stats, self.speculation.monitor
        if speculated:
            for row, tree, step in zip(self.rows, trees, steps):
                path = step.nodes[1:]
                for record in (stats,) if self.batch_size == 1 else (row.stats, stats):
                    record.record_step(tree.depth, len(path), len(step.tokens), step.forwards,
                                       tree.ranks[path].tolist(), tree.frontier_ranks.tolist())
            stats.draft_seconds += drafted - began
            stats.verify_seconds += done - drafted
            accepted = [len(step.nodes) - 1 for step in steps]
            self.speculation.controller.update(max(tree.depth for tree in trees), round(sum(accepted) / len(accepted)))
            monitor.record_speculative(sum(len(step.tokens) for step in steps) / len(self.rows), done - began,
                                       done - drafted)
            stats.fallbacks = monitor.fallbacks
        else:
            stats.plain_steps += 1
            stats.plain_seconds += done - began
            monitor.record_plain(done - began)
        self.stream()

    def stream(self) -> None:
        """Send a single row's new tokens to the streamer."""
        if self.streamer is not None and self.rows:
            sequence = self.rows[0].sequence
            self.streamer.put(sequence[:, self.streamed :].cpu())
            self.streamed = sequence.shape[1]

    def leave(self) -> None:
        """The rows that stopped leave: their cache rows and drafter state are dropped."""
        keep = [b for b, row in enumerate(self.rows) if not row.stopped]
        if len(keep) == len(self.rows):
            return
        self.finished += [row for row in self.rows if row.stopped]
        if keep:
            index = torch.tensor(keep, dtype=torch.long, device=self.key_mask.device)
            self.cache.batch_select_indices(index)
            if self.state is not None:
                self.state.select(index)
            self.key_mask = self.key_mask[index]
        self.rows = [self.rows[b] for b in keep]

    def finish(self):
        """The sequences, padded as plain `generate` pads them, or its output object with this call's statistics."""
        if self.streamer is not None:
            self.streamer.end()
        finished = sorted(self.finished, key=lambda row: row.index)
        length = max(row.sequence.shape[1] for row in finished)
        sequences = torch.full((self.batch_size, length), self.pad, dtype=self.input_ids.dtype,
                               device=self.input_ids.device)
        for row in finished:
            sequences[row.index, : row.sequence.shape[1]] = row.sequence[0]
        if not self.config.return_dict_in_generate:
            return sequences
        return EagleGenerateOutput(
            sequences=sequences,
            scores=tuple(self.scores_out) if self.scores_out is not None else None,
            logits=tuple(self.logits_out) if self.logits_out is not None else None,
            **{CACHE_KWARG: self.cache if self.batch_size == 1 else None},  # a batch's holds holes and its last rows
            speculation_stats=self.stats,
        )


@torch.no_grad()
def eagle_decoding(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                   generation_config: GenerationConfig, drafter: Eagle3DraftModel | None, speculation: Speculation,
                   prepared: Prepared, streamer=None, **model_kwargs):
    """Decode every row of `input_ids` `[B, L]` with EAGLE drafts (none without a drafter: `fast_decoding`) as
    `speculation` plans, on what `prepared` runs; the output equals plain `generate`'s, row for row.

    Runs inside `eagle_verification(model)`, where `prepared` was made (the `generate` routing takes care of both).
    """
    return EagleLoop(model, input_ids, logits_processor, stopping_criteria, generation_config, drafter, speculation,
                     prepared, streamer, **model_kwargs).run()
