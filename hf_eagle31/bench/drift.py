"""The attention-drift study: EAGLE-3 vs EAGLE 3.1 drafters trained with the same budget.

Measured teacher-forced on the target's own greedy continuations of held-out prompts (the chains
greedy EAGLE decoding would draft, see `training.evaluation`), so every position of every sequence
contributes, deep depths included:
  * acceptance per depth, up to `DEPTH`;
  * the same under a prompt template never seen in training;
  * acceptance against context length;
  * the mechanism: at each draft depth, the drafter's attention mass on the first ("sink") tokens
    of the context, and the norm of the state it feeds back to itself.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from hf_eagle31 import modeling
from hf_eagle31.kernels.tree_attention import tree_attention_reference
from hf_eagle31.training import evaluate_acceptance
from hf_eagle31.training.data import TrainingSequence
from hf_eagle31.training.teacher import target_states
from hf_eagle31.training.ttt import unroll

DEPTH = 10
SINK_TOKENS = 4
CONTINUATION = 64  # tokens generated after each context-length prompt
UNSEEN_TEMPLATE = "### Request\n{prompt}\n### Response (continue exactly)\n"


UNSEEN_SYSTEM = "You are Ada, a terse research assistant. Answer formally, without lists."
MAX_CONTEXT = 2048  # longest context measured (the real pair trains on at most 1024 tokens)


def prompt_encoders(tokenizer, chat: bool):
    """(plain, perturbed): text -> ids. A chat model gets its chat template, perturbed by a system prompt and a
    request framing it never saw in training; a plain LM gets the raw text, perturbed by the framing alone."""
    from hf_eagle31.training.data import render

    if chat:
        plain = lambda text: render(tokenizer, [{"role": "user", "content": text}])  # noqa: E731
        perturbed = lambda text: render(tokenizer, [{"role": "system", "content": UNSEEN_SYSTEM},  # noqa: E731
                                                    {"role": "user", "content": UNSEEN_TEMPLATE.format(prompt=text)}])
        return plain, perturbed
    return (lambda text: tokenizer(text).input_ids), (lambda text: tokenizer(UNSEEN_TEMPLATE.format(prompt=text)).input_ids)


@torch.no_grad()
def continuations(target, encode, texts: list[str], new_tokens: int) -> list[TrainingSequence]:
    """The target's greedy continuations; only the continuation counts for acceptance."""
    sequences = []
    for text in texts:
        prompt = torch.tensor([encode(text)], device=target.device)
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens)[0].tolist()
        sequences.append(TrainingSequence(out, [0] * prompt.shape[1] + [1] * (len(out) - prompt.shape[1])))
    return sequences


def long_texts(tokenizer, texts: list[str], length: int, count: int = 8) -> list[str]:
    """`count` prompts of about `length` tokens, spread evenly over the texts joined end to end (none if too short)."""
    ids = tokenizer("\n".join(texts), verbose=False).input_ids  # one long text, cut into windows below
    spare = len(ids) - length  # tokens past one window: where the windows may start
    if spare < 0:
        return []
    starts = sorted({i * spare // max(count - 1, 1) for i in range(count)})
    return [tokenizer.decode(ids[start : start + length]) for start in starts]


def chat_contexts(tokenizer, conversations: list[list[dict]], length: int, count: int = 8) -> list[list[int]]:
    """Up to `count` multi-turn chat prompts of more than half of `length` tokens and at most `length`: the
    longest opening of each conversation (its own answers included) that ends on a user turn, rendered
    through the chat template, as a chat application sends a long conversation."""
    from hf_eagle31.training.data import render

    prompts = []
    for messages in conversations:
        longest = None
        for end, message in enumerate(messages):
            if message["role"] == "user":
                ids = render(tokenizer, messages[: end + 1])
                if len(ids) > length:
                    break
                longest = ids
        if longest is not None and len(longest) > length // 2:
            prompts.append(longest)
        if len(prompts) == count:
            break
    return prompts


@contextmanager
def attention_probe(records: list[torch.Tensor]):
    """Record, for each drafter attention call, the attention weights' mass on the first SINK_TOKENS keys."""

    def probed(query, key, value, tail_mask=None, scale=None):
        n, total = query.shape[-2], key.shape[-2]
        mask = tail_mask if tail_mask is not None else torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        full = torch.cat([mask.new_ones(n, total - mask.shape[-1]), mask], dim=-1)
        groups = query.shape[1] // key.shape[1]
        scores = query.float() @ key.float().repeat_interleave(groups, 1).transpose(-1, -2) * (scale or query.shape[-1] ** -0.5)
        weights = scores.masked_fill(~full, float("-inf")).softmax(-1)
        records.append(weights[..., :SINK_TOKENS].sum(-1).mean(dim=(0, 1)))  # per query position
        return tree_attention_reference(query, key, value, tail_mask, scale)

    original = modeling.tree_attention
    modeling.tree_attention = probed
    try:
        yield
    finally:
        modeling.tree_attention = original


@torch.no_grad()
def mechanism(drafter, target, sequences: list[TrainingSequence]) -> dict:
    """Per depth: mean attention mass on the sink tokens, and mean norm of the fed-back state."""
    sink, norms = torch.zeros(DEPTH), torch.zeros(DEPTH)
    for sequence in sequences:
        ids = torch.tensor([sequence.input_ids], device=target.device)
        features, _ = target_states(target, ids, None, drafter.config.target_layer_ids)
        records: list[torch.Tensor] = []
        with attention_probe(records):
            outputs = unroll(drafter, features, ids, DEPTH)
        start = sum(1 for m in sequence.loss_mask if m == 0)  # only positions inside the continuation
        for k, (mass, out) in enumerate(zip(records, outputs)):
            sink[k] += mass[start:].mean().item()
            norms[k] += out.hidden_states[0, start:].float().norm(dim=-1).mean().item()
    count = len(sequences)
    return {"sink_attention": (sink / count).tolist(), "feedback_norm": (norms / count).tolist()}


def run_drift_study(target, tokenizer, drafters: dict, texts: list[str], args,
                    documents: list[str] | list[list[dict]] | None = None, meta: dict | None = None,
                    chat: bool = False) -> int:
    """`texts` are prompts (through the chat template when `chat`). Context-length prompts are multi-turn
    conversations when `documents` are message lists and the target chats, else raw windows cut from
    `documents` (long held-out texts) or from `texts`.

    drift.json holds `meta` (command, date, machine) beside the per-drafter results under "drafters".
    """
    encode, perturbed = prompt_encoders(tokenizer, chat)
    plain = continuations(target, encode, texts, args.max_new_tokens)
    templated = continuations(target, perturbed, texts, args.max_new_tokens)
    max_context = min(MAX_CONTEXT, target.config.max_position_embeddings - 2 * CONTINUATION)  # positions left to continue
    lengths = [n for n in (32, 64, 128, 256, 512, 1024) if n < max_context] + [max_context]
    if chat and documents and isinstance(documents[0], list):
        contexts = lambda n: chat_contexts(tokenizer, documents, n)  # noqa: E731
        encode_context = lambda ids: ids  # noqa: E731
    else:
        contexts = lambda n: long_texts(tokenizer, documents or texts, n)  # noqa: E731
        encode_context = lambda text: tokenizer(text).input_ids  # noqa: E731
    by_length = {n: continuations(target, encode_context, contexts(n), CONTINUATION) for n in lengths}
    by_length = {n: seqs for n, seqs in by_length.items() if seqs}
    results = {}
    for name, drafter in drafters.items():
        results[name] = {
            "acceptance": evaluate_acceptance(drafter, target, plain, depth=DEPTH).as_dict(),
            "unseen_template": evaluate_acceptance(drafter, target, templated, depth=DEPTH).as_dict(),
            "context_length": {n: evaluate_acceptance(drafter, target, seqs, depth=DEPTH).as_dict()
                               for n, seqs in by_length.items()},
            "mechanism": mechanism(drafter, target, plain[:4]),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.json").write_text(json.dumps({**(meta or {}), "drafters": results}, indent=2))
    table = drift_table(results)
    (out / "drift.md").write_text(table + "\n")
    plot_drift(out, results)
    print(table)
    print(f"\nwritten to {out}/ (drift.json, drift.md, drift.png)")
    return 0


def drift_table(results: dict) -> str:
    names = list(results)
    rows = ["| measure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label, values):
        rows.append(f"| {label} | " + " | ".join(values) + " |")

    for k in range(DEPTH):
        row(f"acceptance at depth {k + 1}", [f"{results[n]['acceptance']['acceptance'][k]:.3f}" for n in names])
    deep = lambda r: sum(r["acceptance"][4:]) / len(r["acceptance"][4:])  # noqa: E731
    row("mean acceptance at depths 5+", [f"{deep(results[n]['acceptance']):.3f}" for n in names])
    row(f"accepted tokens per {DEPTH}-token chain", [f"{results[n]['acceptance']['greedy_length']:.2f}" for n in names])
    row("same, unseen prompt template", [f"{results[n]['unseen_template']['greedy_length']:.2f}" for n in names])
    for length in results[names[0]]["context_length"]:
        row(f"same, {length}-token context", [f"{results[n]['context_length'][length]['greedy_length']:.2f}" for n in names])
    row("expected accepted length under sampling (sum of prod of sum min(p, q))",
        [f"{results[n]['acceptance']['expected_length']:.2f}" for n in names])
    for k in (0, DEPTH // 2, DEPTH - 1):
        row(f"sink attention at depth {k + 1}", [f"{results[n]['mechanism']['sink_attention'][k]:.3f}" for n in names])
        row(f"feedback norm at depth {k + 1}", [f"{results[n]['mechanism']['feedback_norm'][k]:.1f}" for n in names])
    return "\n".join(rows)


def plot_drift(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    depths = range(1, DEPTH + 1)
    for index, (name, r) in enumerate(results.items()):
        style = {"color": f"C{index}", "marker": "o", "label": name}  # one colour per drafter in every panel
        axes[0].plot(depths, r["acceptance"]["acceptance"], **style)
        axes[0].plot(depths, r["unseen_template"]["acceptance"], **{**style, "linestyle": "--", "marker": "x",
                                                                     "label": f"{name}, unseen template"})
        lengths = list(r["context_length"])
        axes[1].plot([int(n) for n in lengths], [r["context_length"][n]["greedy_length"] for n in lengths], **style)
        axes[2].plot(depths, r["mechanism"]["sink_attention"], **style)
        axes[3].plot(depths, r["mechanism"]["feedback_norm"], **style)
    axes[0].set(xlabel="draft depth", ylabel="acceptance (given the path so far)", ylim=(0, 1.05))
    axes[1].set(xlabel="context length (tokens)", ylabel=f"accepted tokens per {DEPTH}-token chain", xscale="log")
    axes[2].set(xlabel="draft depth", ylabel=f"attention on first {SINK_TOKENS} tokens")
    axes[3].set(xlabel="draft depth", ylabel="norm of fed-back state")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "drift.png", dpi=120)
    plt.close(fig)
