"""Reading chat data and self-distillation, against references: plain one-prompt `generate` for every
answer, a straight run for a resumed one, hand-written records for the parser."""

import copy
import json

import pytest
import torch
from tiny_models import make_target, make_tokenizer

import hf_eagle31.training.distill as distill
from hf_eagle31.cli import main as cli_main
from hf_eagle31.packaged import PACKAGED, PackagedModel, load_packaged_model
from hf_eagle31.training.data import Conversation, read_examples, read_records, render
from hf_eagle31.training.distill import DistillSettings, distill_conversations, distill_to_folder, exclude_overlaps

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello"},
                                  {"from": "gpt", "value": "hi"}, {"from": "human", "value": "again"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "an answer alone"}]},
    {"id": "c", "messages": [{"role": "user", "content": "world"}]},
]


@pytest.fixture(scope="module")
def target():
    return make_target()


def reference_answer(target, prompt: list[int], limit: int) -> list[int]:
    ids = torch.tensor([prompt])  # the tiny tokenizer maps blank lines to id 0, the pad id: the mask says "no padding"
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                          pad_token_id=0)[0, len(prompt):]
    answer = out.tolist()
    return answer[: answer.index(2) + 1] if 2 in answer else answer


def test_a_json_list_cut_off_mid_record_yields_the_complete_records(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT)[:-30])
    with pytest.warns(UserWarning, match="cut off after 2 complete records"):
        records = list(read_records(path))
    assert [r["id"] for r in records] == ["a", "b"]
    examples = read_examples(SHAREGPT)
    assert [(c.user_turns, c.system) for c in examples.conversations] == [(["hello", "again"], "be brief"),
                                                                          (["world"], None)]
    assert examples.skipped == 1
    with pytest.raises(ValueError, match="record 1 is a JSON list"):
        read_examples([["not", "a", "record"]])
    with pytest.raises(ValueError, match="role 'robot'"):
        read_examples([{"conversations": [{"from": "robot", "value": "x"}]}])


def test_every_turn_is_answered_as_plain_generate_answers_it(target):
    tokenizer = make_tokenizer()
    conversations = [Conversation(["ab", "cd"]), Conversation(["hello world" * 3]), Conversation(["xyz", "q"])]
    settings = DistillSettings(max_length=200, max_new_tokens=12, max_turns=None, batch_size=2)
    sequences, report = distill_conversations(target, tokenizer, conversations, settings)
    assert report.conversations == 3 and len(sequences) == 3
    for conversation, sequence in zip(conversations, sequences):
        messages, ids, mask = [], [], []
        for turn in conversation.user_turns:
            messages.append({"role": "user", "content": turn})
            prompt = render(tokenizer, messages)
            answer = reference_answer(target, prompt, 12)
            kept = mask if prompt[: len(ids)] == ids else []
            mask = kept + [0] * (len(prompt) - len(kept)) + [1] * len(answer)
            ids = prompt + answer
            finished = answer[-1] == 2
            messages.append({"role": "assistant", "content": tokenizer.decode(answer[:-1] if finished else answer,
                                                                              skip_special_tokens=True)})
            if not finished:
                break
        assert sequence.input_ids == ids
        assert sequence.loss_mask == mask
    assert report.answer_tokens == sum(sum(s.loss_mask) for s in sequences)


def test_too_long_first_turns_are_counted_and_later_turns_stop_at_max_length(target):
    tokenizer = make_tokenizer()
    conversations = [Conversation(["a" * 80]), Conversation(["ab", "cd" * 30])]
    settings = DistillSettings(max_length=40, max_new_tokens=8, batch_size=4)
    sequences, report = distill_conversations(target, tokenizer, conversations, settings)
    assert report.too_long == 1 and len(sequences) == 1
    assert all(len(s.input_ids) <= 40 for s in sequences)


def test_an_interrupted_distillation_resumes_at_the_first_missing_chunk(target, tmp_path, monkeypatch):
    tokenizer = make_tokenizer()
    conversations = [Conversation([w]) for w in ["ab", "cd", "ef", "gh", "ij"]]
    settings = DistillSettings(max_length=100, max_new_tokens=6, batch_size=4)
    straight, _ = distill_to_folder(target, tokenizer, conversations, tmp_path / "straight", settings, chunk_size=2)

    distill_to_folder(target, tokenizer, conversations, tmp_path / "resumed", settings, token_budget=1, chunk_size=2)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("chunk_*")) == ["chunk_00000.jsonl"]
    real, asked = distill.distill_conversations, []
    monkeypatch.setattr(distill, "distill_conversations", lambda t, k, c, *a: asked.append(len(c)) or real(t, k, c, *a))
    resumed, report = distill_to_folder(target, tokenizer, conversations, tmp_path / "resumed", settings, chunk_size=2)
    assert asked == [2, 1]  # chunk 0 was not answered again
    assert [s.input_ids for s in resumed] == [s.input_ids for s in straight]
    assert report.conversations == 5
    with pytest.raises(ValueError, match="other settings"):
        distill_to_folder(target, tokenizer, conversations, tmp_path / "resumed",
                          DistillSettings(max_length=100, max_new_tokens=7, batch_size=4), chunk_size=2)
    with pytest.raises(ValueError, match="other dtype"):  # a bf16 target writes other answers than an fp32 one
        distill_to_folder(copy.deepcopy(target).to(torch.bfloat16), tokenizer, conversations, tmp_path / "resumed",
                          settings, chunk_size=2)
    assert len(read_examples(tmp_path / "resumed").sequences) == 5  # the folder is training data as it is


def test_benchmark_prompts_are_kept_out():
    held_out = ["Write a short poem about the sea and the sky at night", "Hi"]
    conversations = [Conversation(["please write a short poem about the sea and the sky at night, thanks"]),
                     Conversation(["something else", "hi"]), Conversation(["a poem about the sea"])]
    assert [c.user_turns for c in exclude_overlaps(conversations, held_out)] == [["a poem about the sea"]]


def test_distill_command(tmp_path, capsys):
    make_target().save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "sharegpt.json").write_text(json.dumps(SHAREGPT))
    argv = ["distill", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "sharegpt.json"),
            "--out", str(tmp_path / "out"), "--max-new-tokens", "6", "--max-length", "64"]
    assert cli_main(argv) == 0
    assert "2 conversations, 2 answers, 12 answer tokens" in capsys.readouterr().out  # answers cut at 6 end a chat
    assert cli_main([*argv[:-4], "--max-new-tokens", "7", "--max-length", "64"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_a_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(PACKAGED, "nothing", PackagedModel("no_such_module_here", "x.gguf", "pip install no-such",
                                                                "acme/nothing"))
    monkeypatch.setenv("HF_EAGLE31_CACHE", str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="pip install no-such"):
        load_packaged_model("nothing")
    with pytest.raises(ValueError, match="unknown packaged model 'smollm3'"):
        load_packaged_model("smollm3")


def test_given_answers_are_the_records_own_in_the_chat_template_and_nothing_is_generated(target, tmp_path,
                                                                                           monkeypatch):
    tokenizer = make_tokenizer()
    end = tokenizer.eos_token_id
    assert end in distill.eos_ids(target)
    records = [{"conversations": [{"from": "human", "value": "ab"}, {"from": "gpt", "value": "cd ef"},
                                  {"from": "human", "value": "gh"}, {"from": "gpt", "value": "ij"}]},
               {"conversations": [{"from": "human", "value": "kl"}, {"from": "gpt", "value": "mn " * 40},
                                  {"from": "human", "value": "never asked: the answer before it was cut"}]},
               {"conversations": [{"from": "human", "value": "op"}, {"from": "human", "value": "unanswered"}]}]
    conversations = read_examples(records).conversations
    assert [c.answers for c in conversations] == [["cd ef", "ij"], ["mn " * 40], []]
    monkeypatch.setattr(target, "generate", lambda *a, **k: pytest.fail("given answers generate nothing"))
    settings = DistillSettings(max_length=200, max_new_tokens=12, batch_size=2)
    sequences, report = distill_conversations(target, tokenizer, conversations, settings, answers="given")

    def expected(turns: list[str], answers: list[str]) -> tuple[list[int], list[int]]:
        messages, ids, mask = [], [], []
        for turn, text in zip(turns, answers):
            messages.append({"role": "user", "content": turn})
            prompt = render(tokenizer, messages)
            answer = (tokenizer(text, add_special_tokens=False)["input_ids"] + [end])[:12]
            kept = mask if prompt[: len(ids)] == ids else []
            mask = kept + [0] * (len(prompt) - len(kept)) + [1] * len(answer)
            ids = prompt + answer
            messages.append({"role": "assistant", "content": text})
            if answer[-1] != end:
                break
        return ids, mask

    assert (sequences[0].input_ids, sequences[0].loss_mask) == expected(["ab", "gh"], ["cd ef", "ij"])
    assert (sequences[1].input_ids, sequences[1].loss_mask) == expected(["kl", "x"], ["mn " * 40, "y"])
    assert report.turns == 3 and len(sequences) == 2  # the third record has no answer to learn from
    distill_to_folder(target, tokenizer, conversations, tmp_path / "given", settings, answers="given")
    with pytest.raises(ValueError, match="other conversations and answers"):
        distill_to_folder(target, tokenizer, conversations, tmp_path / "given", settings)
