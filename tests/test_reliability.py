"""What users run into outside the happy path: threads sharing a target, padded prompts, bad inputs.

Every expectation is a reference from outside the project: plain `generate`'s output, or the
error text a user should read.
"""

import copy
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import PROMPTS, make_drafter, make_target, make_tokenizer, trained_pair
from transformers.generation.streamers import BaseStreamer
from transformers.utils.logging import disable_progress_bar, enable_progress_bar

from hf_eagle31 import Eagle3DraftModel
from hf_eagle31.cli import main
from hf_eagle31.conversion.layouts import CheckpointError
from hf_eagle31.exact import RowByRowLinear


def plain(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, **kwargs)


def drafter_copy(target, drafter, **speculation):
    """A second drafter object with its own speculation settings (the same weights)."""
    other = copy.deepcopy(drafter)
    other.set_target_embedding(target.get_input_embeddings())
    for name, value in speculation.items():
        setattr(other.generation_config, name, value)
    return other


class OnStep(BaseStreamer):
    """Streams nothing; runs `actions[k]` at the call's k-th put (the first is the prompt, then one per step)."""

    def __init__(self, actions: dict):
        self.actions, self.puts = actions, 0

    def put(self, value):
        self.puts += 1
        self.actions.get(self.puts, lambda: None)()

    def end(self):
        pass


def handoff(signal: threading.Event, wait: threading.Event) -> None:
    signal.set()
    if not wait.wait(120):
        raise TimeoutError("the other thread never got there")


@pytest.mark.parametrize("second", ["chain", "chain-exact", "same-drafter"])
def test_two_threads_on_one_target_each_get_plain_greedy_output(second):
    """A web service's worker threads sharing one target: a long tree call, and short calls beside it.

    The first short call starts decoding before the long one and ends while the long one decodes,
    which then takes a few steps alone (the streamers hold each call until the other got there):
    what one call switches on for itself must not be switched off under another. The later short
    calls run freely beside the long one.
    """
    target, tree = trained_pair("llama", True, speculation_mode="tree", collapse_fallback=False)
    other = {"chain": lambda: drafter_copy(target, tree, speculation_mode="chain"),
             "chain-exact": lambda: drafter_copy(target, tree, speculation_mode="chain", verify_mode="exact"),
             "same-drafter": lambda: tree}[second]()
    long_prompt, short_prompts = PROMPTS[0:1], [PROMPTS[i : i + 1] for i in (3, 1, 4, 2, 5, 3)]
    expected = [[plain(target, long_prompt, max_new_tokens=150)],
                [plain(target, p, max_new_tokens=20) for p in short_prompts]]
    settings = (target.config.to_dict(), target.generation_config.to_dict())
    events = short_in, long_in, short_done, long_on = [threading.Event() for _ in range(4)]
    outputs, problems = [[], []], []

    def run(index, drafter, calls):
        try:
            for prompt, new_tokens, streamer in calls:
                outputs[index].append(target.generate(prompt, do_sample=False, max_new_tokens=new_tokens,
                                                      assistant_model=drafter, streamer=streamer))
                if index == 1 and len(outputs[1]) == 1:
                    handoff(short_done, long_on)
        except Exception as err:  # noqa: BLE001  (reported below, with the thread it came from)
            problems.append(f"thread {index}: {type(err).__name__}: {err}")
        finally:
            for event in events:  # never leave the other thread waiting
                event.set()
        if any(isinstance(mode, RowByRowLinear) for mode in torch.overrides._get_current_function_mode_stack()):
            problems.append(f"thread {index}: row-by-row linears left on")

    def long_thread():
        short_in.wait(120)
        run(0, tree, [(long_prompt, 150, OnStep({2: lambda: handoff(long_in, short_done), 6: long_on.set}))])

    short_calls = [(short_prompts[0], 20, OnStep({2: lambda: handoff(short_in, long_in)}))]
    short_calls += [(prompt, 20, None) for prompt in short_prompts[1:]]
    threads = [threading.Thread(target=long_thread), threading.Thread(target=run, args=(1, other, short_calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems
    for index in range(2):
        assert [o.tolist() for o in outputs[index]] == [e.tolist() for e in expected[index]], f"thread {index}"
    assert target.config._attn_implementation == "sdpa"  # as transformers loaded it
    assert (target.config.to_dict(), target.generation_config.to_dict()) == settings
    assert not target._forward_hooks and not target._forward_pre_hooks


@pytest.mark.parametrize("verify_mode", ["batched", "exact"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_left_padded_prompt_gives_plain_greedy_output(mode, verify_mode):
    """A tokenizer that pads: the attention mask must reach every verify forward."""
    target, drafter = trained_pair("llama", True, speculation_mode=mode, verify_mode=verify_mode,
                                   collapse_fallback=False)
    for prompt in (PROMPTS[0:1], PROMPTS[3:4]):
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
        mask = (padded != 0).long()
        expected = plain(target, padded, attention_mask=mask, max_new_tokens=40, pad_token_id=0)
        out = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0,
                              assistant_model=drafter)
        assert torch.equal(out, expected), prompt.tolist()
        assert drafter.speculation_stats.tau > 1.5  # drafting from the real tokens, not from the pads


# --- bad inputs: a named one-line error, nothing written ---------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target (with a tokenizer) and a drafter for it, saved as a user would have them."""
    folder = tmp_path_factory.mktemp("models")
    target = make_target("llama")
    target.save_pretrained(folder / "target")
    make_tokenizer().save_pretrained(folder / "target")
    make_drafter(target).save_pretrained(folder / "drafter")
    return folder


def damaged(models, tmp_path, damage) -> Path:
    """A copy of the saved drafter, with `damage(folder)` done to it."""
    folder = tmp_path / "damaged"
    shutil.copytree(models / "drafter", folder)
    damage(folder)
    return folder


def edit_weights(edit):
    def damage(folder):
        weights = load_file(folder / "model.safetensors")
        edit(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return damage


def edit_config(**changes):
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return damage


def rename_midlayer(weights):
    for key in [k for k in weights if k.startswith("midlayer.")]:
        weights["layers.0." + key.removeprefix("midlayer.")] = weights.pop(key)


def object_pickle(folder):
    """An EAGLE reference checkpoint (a pickle) that holds more than tensors."""
    (folder / "model.safetensors").unlink()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save({"fc.weight": torch.zeros(2), "optimizer": threading.Event}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("damage, error", [
    (edit_weights(lambda w: w.pop("midlayer.mlp.up_proj.weight")), r"missing weights \['midlayer.mlp.up_proj.weight'\]"),
    (edit_weights(lambda w: w.pop("fc_norm.1.weight")), r"missing weights \['fc_norm.1.weight'\]"),
    (edit_weights(lambda w: w.pop("d2t")), r"missing weights \['d2t'\]"),
    (edit_weights(rename_midlayer), r"missing weights \['midlayer.*unexpected weights \['layers.0."),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors is not a readable safetensors file .*incomplete or corrupt"),
    (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors is not a readable safetensors file"),
    (lambda f: (f / "model.safetensors").write_text("<html>404</html>"), "is not a readable safetensors file"),
    (edit_config(hidden_size=128), r"fc.weight has shape \(64, 192\) but the config implies \(128, 192\)"),
    (edit_config(intermediate_size=256), r"down_proj.weight has shape \(64, 128\) but the config implies \(64, 256\)"),
    (edit_config(draft_vocab_size=128), r"lm_head.weight has shape \(256, 64\) but the config implies \(128, 64\)"),
    (edit_config(num_attention_heads=3), "config.json does not describe a valid drafter: num_attention_heads"),
    (lambda f: (f / "config.json").write_text('{"model_type": "eagle3_'), "config.json is not valid JSON"),
    (object_pickle, "pytorch_model.bin is not a pickle of plain tensors that torch .* can load safely"),
    (edit_weights(lambda w: w["fc.weight"].view(-1)[7].fill_(float("nan"))), "fc.weight hold NaN or infinite values"),
    (edit_weights(lambda w: w["lm_head.weight"].view(-1)[0].fill_(float("-inf"))), "lm_head.weight hold NaN or infinite"),
    (edit_weights(lambda w: w["d2t"].__setitem__(250, 9)), r"d2t maps 1 draft ids \(the first: 250\) to target ids "
                                                           "outside the target vocabulary of 256 tokens"),
    (edit_weights(lambda w: w["d2t"].__setitem__(3, -4)), r"d2t maps 1 draft ids \(the first: 3\)"),
    (edit_config(rope_parameters={"rope_type": "default", "rope_theta": "10000"}), "rope_theta must be a number, got "
                                                                                   "'10000'"),
    (lambda f: (f / "generation_config.json").write_text('{"speculation_mode": "tr'),
     "generation_config.json is not valid JSON"),
], ids=["missing-tensor", "missing-fc-norm", "missing-d2t", "renamed-layer", "truncated", "empty", "html",
        "hidden-size", "intermediate-size", "draft-vocab", "heads", "truncated-config", "object-pickle", "nan", "inf",
        "d2t-past-the-vocabulary", "d2t-negative", "rope-theta-string", "truncated-generation-config"])
def test_bad_checkpoints_get_named_errors(models, tmp_path, damage, error):
    """The project's own layout is read as strictly as the others: nothing random, nothing raw."""
    with pytest.raises(CheckpointError, match=error):
        Eagle3DraftModel.from_pretrained(damaged(models, tmp_path, damage), allow_pickle=True)


def test_a_drafter_on_another_device_is_named():
    target, drafter = trained_pair("llama", True)
    elsewhere = copy.deepcopy(drafter).to("meta")
    with pytest.raises(ValueError, match=r"the drafter is on meta but the target's embedding computes on cpu: move "
                                         r"the drafter there with drafter.to\('cpu'\)"):
        target.generate(PROMPTS[:1], do_sample=False, max_new_tokens=5, assistant_model=elsewhere)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's usage errors
        return exit.code


def tree_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("argv, error", [
    (["convert", "{drafter}", "{tmp}/file.txt"], "file.txt is a file: give a folder"),
    (["convert", "{drafter}", "{tmp}/full"], "full is not empty: choose a new folder, or pass --overwrite"),
    (["convert", "{drafter}", "{tmp}/new", "--layout", "vllm"], "argument --layout: invalid choice: 'vllm'"),
    (["convert", "{tmp}/nothing", "{tmp}/new"], "no such folder: .*/nothing$"),
    (["train", "--target", "{target}", "--data", "{tmp}/lists.jsonl", "--out", "{tmp}/new", "--steps", "1"],
     "training record 1 has no"),
    (["train", "--target", "{tmp}/nothing", "--data", "{tmp}/lists.jsonl", "--out", "{tmp}/new", "--steps", "1"],
     "no such folder: .*/nothing$"),
    (["train", "--target", "{target}", "--data", "{tmp}/lists.jsonl", "--out", "{tmp}/new"],
     "one of the arguments --steps --epochs is required"),
    (["distill", "--target", "{target}", "--data", "{tmp}/no.jsonl", "--out", "{tmp}/new"], "no.jsonl does not exist"),
    (["bench", "--target", "{tmp}/nothing", "--out", "{tmp}/new"], "no such folder: .*/nothing$"),
    (["plan", "--target", "{target}", "--gpu-mem", ""], "cannot read GPU memory ''"),
    (["plan", "--target", "{target}", "--gpu-mem", "0"], "GPU memory '0' is no memory at all"),
    (["plan", "--target", "{target}", "--context", "many"], "argument --context: invalid int value: 'many'"),
    (["card", "{tmp}/nothing"], "no such folder: .*/nothing$"),
    (["card", "{tmp}/full"], "full does not hold a drafter config"),
    (["upgrade"], "invalid choice: 'upgrade'"),
], ids=["convert-onto-file", "convert-into-full-folder", "convert-layout", "convert-missing", "train-json-lists",
        "train-missing-target", "train-no-budget", "distill-missing-data", "bench-missing-target", "plan-empty-memory",
        "plan-zero-memory", "plan-context", "card-missing", "card-not-a-drafter", "unknown-command"])
def test_cli_bad_inputs_exit_2_with_one_line_and_write_nothing(models, tmp_path, capsys, argv, error):
    (tmp_path / "file.txt").write_text("notes\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "README.md").write_text("another drafter\n")
    (tmp_path / "lists.jsonl").write_text('[{"role": "user", "content": "hi"}]\n[{"role": "user", "content": "yo"}]\n')
    before = tree_of(tmp_path)
    names = {"drafter": models / "drafter", "target": models / "target", "tmp": tmp_path}
    disable_progress_bar()  # transformers' loading bars share stderr with the error
    try:
        code = run_cli([arg.format(**names) for arg in argv])
    finally:
        enable_progress_bar()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    prog = f"hf-eagle31 {argv[0]}" if argv[0] != "upgrade" else "hf-eagle31"
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ")
    assert re.search(error, err[0]), err[0]
    assert tree_of(tmp_path) == before


def test_convert_into_an_existing_folder_replaces_it_whole(models, tmp_path, capsys, monkeypatch):
    """Never a folder that loads as one model and documents another; never a half-written one."""
    other = tmp_path / "other"
    shutil.copytree(models / "drafter", other)
    for name in ("README.md", "train_log.csv", "training_args.json", "tuning.json"):
        (other / name).write_text("another drafter\n")
    before = tree_of(other)
    assert run_cli(["convert", str(models / "drafter"), str(other)]) == 2
    assert "is not empty" in capsys.readouterr().err and tree_of(other) == before

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_eagle31.conversion.layouts.save_file", disk_full)
    assert run_cli(["convert", str(models / "drafter"), str(other), "--layout", "speculators", "--overwrite",
                    "--verifier", "example-org/target"]) == 2
    assert "disk full" in capsys.readouterr().err
    assert tree_of(other) == before and sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # no scratch left
    monkeypatch.undo()

    assert run_cli(["convert", str(models / "drafter"), str(tmp_path / "fresh")]) == 0
    assert run_cli(["convert", str(models / "drafter"), str(other), "--overwrite"]) == 0
    assert tree_of(other) == tree_of(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "other"]
    original, converted = (Eagle3DraftModel.from_pretrained(folder) for folder in (models / "drafter", other))
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), converted.state_dict().values()))


def test_convert_refuses_a_damaged_head_and_writes_nothing(models, tmp_path, capsys):
    folder = damaged(models, tmp_path, edit_weights(lambda w: w["fc.weight"].view(-1)[0].fill_(float("nan"))))
    assert run_cli(["convert", str(folder), str(tmp_path / "out"), "--layout", "specforge"]) == 2
    assert "fc.weight hold NaN or infinite values" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("destination", ["source", "parent"])
def test_convert_overwrite_never_replaces_its_own_source(models, tmp_path, capsys, destination):
    source = tmp_path / "drafters" / "mine"
    shutil.copytree(models / "drafter", source)
    before = tree_of(tmp_path)
    dst = source if destination == "source" else source.parent
    assert run_cli(["convert", str(source), str(dst), "--overwrite"]) == 2
    assert "holds it: replacing it would delete the source" in capsys.readouterr().err
    assert tree_of(tmp_path) == before


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_converted_folders_get_the_usual_permissions(models, tmp_path, umask_022):
    """A converted folder is shared like any other: rwxr-xr-x under umask 022, also when it replaces one."""
    (tmp_path / "replaced").mkdir(mode=0o755)
    (tmp_path / "replaced" / "old.txt").write_text("old\n")
    for name in ("new", "replaced"):
        assert run_cli(["convert", str(models / "drafter"), str(tmp_path / name), "--overwrite"]) == 0
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o755


def three_token_records(tmp_path) -> Path:
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5 + i, 6 + i, 7 + i]}) + "\n" for i in range(4)))
    return data


def train_argv(models, data, out) -> list[str]:
    return ["train", "--target", str(models / "target"), "--data", str(data), "--out", str(out), "--steps", "2",
            "--tune-prompts", "0", "--save-every", "1"]


def test_train_on_sequences_shorter_than_the_unroll(models, tmp_path):
    """Three tokens leave fewer positions than the unrolled draft steps: those run past the end, masked."""
    assert run_cli(train_argv(models, three_token_records(tmp_path), tmp_path / "out")) == 0
    assert Eagle3DraftModel.from_pretrained(tmp_path / "out").config.vocab_size == 256


def crash_at_step(monkeypatch, step: int):
    """`train` fails in its `step`-th training step (as a crash or bad data found late would)."""
    from hf_eagle31.training import trainer

    real, calls = trainer.training_step, []

    def training_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("crashed")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "training_step", training_step)


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_train_run_leaves_no_partial_output(models, tmp_path, monkeypatch, existing):
    """What the failed run wrote goes; what the folder held before stays."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "notes.md").write_text("mine\n")
    before = tree_of(tmp_path)
    data = three_token_records(tmp_path)
    crash_at_step(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="crashed"):
        run_cli(train_argv(models, data, out))
    assert tree_of(tmp_path) == {**before, "short.jsonl": data.read_bytes()}


def test_a_failed_train_run_keeps_its_checkpoints_to_resume_from(models, tmp_path, monkeypatch):
    data, out = three_token_records(tmp_path), tmp_path / "out"
    crash_at_step(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="crashed"):
        run_cli(train_argv(models, data, out))
    assert (out / "checkpoints" / "step_00000001" / "trainer_state.json").is_file()
    monkeypatch.undo()
    assert run_cli([*train_argv(models, data, out), "--resume"]) == 0


@pytest.mark.parametrize("records, error", [
    ('{"text": "hello"}\n{"id": 7}\n', "prompts.jsonl: prompt record 2 has neither a 'text' string nor a non-empty "
                                       "list of 'turns'"),
    ('{"text": "hello"}\n{"text": "cut\n', r"prompts.jsonl, line 2: not valid JSON \("),
], ids=["no-text", "truncated"])
def test_bench_prompts_without_text_are_named(models, tmp_path, capsys, records, error):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(records)
    assert run_cli(["bench", "--target", str(models / "target"), "--eagle31", str(models / "drafter"), "--prompts",
                    str(prompts), "--out", str(tmp_path / "bench")]) == 2
    assert re.search(error, capsys.readouterr().err)
    assert not (tmp_path / "bench").exists()
