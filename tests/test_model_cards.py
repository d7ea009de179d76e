"""Model cards: valid Hub metadata that parses back, and the facts a user picks a drafter by."""

import json

import pytest
from huggingface_hub import ModelCard
from tiny_models import make_drafter, make_target

from hf_eagle31.cli import main as cli_main
from hf_eagle31.model_cards.card import write_model_card


@pytest.fixture()
def drafter_dir(tmp_path):
    target = make_target()
    make_drafter(target, eagle31=True, draft_vocab_size=200).save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


def test_card_parses_back_with_metadata(drafter_dir):
    write_model_card(drafter_dir, base_model="acme/tiny-llama", training={"sequences": 48, "ttt_steps": 4})
    card = ModelCard.load(drafter_dir / "README.md")
    assert card.data.base_model == "acme/tiny-llama"
    assert card.data.library_name == "hf-eagle31"
    assert card.data.license == "apache-2.0"
    assert {"eagle3.1", "speculative-decoding"} <= set(card.data.tags)
    text = card.text
    assert "| `fc_norm` (per-layer RMSNorm of the captured states) | True |" in text
    assert "| target layers read (`target_layer_ids`, index 0 = embedding output) | [2, 3, 3] |" in text
    assert "| draft vocabulary / target vocabulary | 200 / 256 |" in text
    assert "| sequences | 48 |" in text
    assert "Measured acceptance" not in text


def test_eagle3_card_and_acceptance_table_from_benchmark_file(tmp_path):
    target = make_target()
    folder = tmp_path / "eagle3"
    make_drafter(target, eagle31=False).save_pretrained(folder)
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"runs": [
        {"name": "chain", "tau": 2.5, "speedup": 1.8, "acceptance_per_depth": [0.8, 0.6, 0.4]},
        {"name": "teacher-forced", "acceptance": [0.75, 0.5]},
    ]}))
    assert cli_main(["card", str(folder), "--base-model", "acme/tiny", "--bench", str(bench), "--license", "mit"]) == 0
    card = ModelCard.load(folder / "README.md")
    assert "eagle3" in card.data.tags and "eagle3.1" not in card.data.tags and card.data.license == "mit"
    # a run without the best plain decoding measured: its speedup is over default generate only, and says so
    assert "| chain | 2.500 | – | 1.800 | 0.800 | 0.600 | 0.400 |" in card.text
    assert "| teacher-forced | – | – | – | 0.750 | 0.500 | – |" in card.text


def test_a_bench_results_file_gives_the_drafters_own_rows(drafter_dir):
    """`hf-eagle31 bench` writes every method of a run; an EAGLE 3.1 card keeps the EAGLE 3.1 ones."""
    methods = [{"name": "target alone", "tau": 1.0, "speedup": 0.9, "speedup_default": 1.0, "acceptance_per_depth": []},
               {"name": "EAGLE-3 tree", "tau": 1.9, "speedup": 1.08, "speedup_default": 1.2, "acceptance_per_depth": [0.7]},
               {"name": "EAGLE 3.1 tree", "tau": 2.17, "speedup": 1.17, "speedup_default": 1.3,
                "acceptance_per_depth": [0.79, 0.4]}]
    card = write_model_card(drafter_dir, benchmark={"command": "hf-eagle31 bench", "methods": methods})
    assert "| EAGLE 3.1 tree | 2.170 | 1.170 | 1.300 | 0.790 | 0.400 |" in card.text
    assert "EAGLE-3 tree" not in card.text and "target alone" not in card.text
    with pytest.raises(ValueError, match="no EAGLE 3.1 method"):
        write_model_card(drafter_dir, benchmark={"methods": methods[:2]})


def test_training_args_fill_the_card(drafter_dir):
    (drafter_dir / "training_args.json").write_text(json.dumps({"target": "acme/base", "steps": 100, "resume": False}))
    card = write_model_card(drafter_dir)
    assert ModelCard.load(drafter_dir / "README.md").data.base_model == "acme/base"
    assert "| steps | 100 |" in card.text and "resume" not in card.text
    assert "Self-distillation: the target answered" in card.text
    for answers, says in [("given", "it wrote none of them"), ("target+given", "part of the training")]:
        (drafter_dir / "training_args.json").write_text(json.dumps({"target": "acme/base", "answers": answers}))
        text = write_model_card(drafter_dir).text
        assert says in text and "Self-distillation: the target answered" not in text


def test_bad_inputs(tmp_path, drafter_dir, capsys):
    with pytest.raises(ValueError, match="does not hold a drafter config"):
        write_model_card(tmp_path)
    with pytest.raises(ValueError, match="no 'acceptance_per_depth'"):
        write_model_card(drafter_dir, benchmark={"tau": 2.0})
    assert cli_main(["card", str(drafter_dir), "--bench", str(tmp_path / "missing.json")]) == 2
    assert "cannot read benchmark results" in capsys.readouterr().err


def test_a_readme_it_did_not_write_is_kept_unless_overwrite_is_asked(drafter_dir, capsys):
    (drafter_dir / "README.md").write_text("# My drafter\n\nNotes I wrote by hand.\n")
    assert cli_main(["card", str(drafter_dir)]) == 2
    assert "was not written by hf-eagle31" in capsys.readouterr().err
    assert (drafter_dir / "README.md").read_text().startswith("# My drafter")
    assert cli_main(["card", str(drafter_dir), "--overwrite"]) == 0
    assert ModelCard.load(drafter_dir / "README.md").data.library_name == "hf-eagle31"
    assert cli_main(["card", str(drafter_dir)]) == 0  # its own card: rewritten without asking


def test_a_folder_without_a_saved_drafter_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert cli_main(["card", str(tmp_path)]) == 2
    assert "not an eagle3_drafter config" in capsys.readouterr().err and not (tmp_path / "README.md").exists()
    make_drafter(make_target()).config.save_pretrained(tmp_path)  # a config, but no weights
    assert cli_main(["card", str(tmp_path)]) == 2
    assert "holds no drafter weights" in capsys.readouterr().err and not (tmp_path / "README.md").exists()


def test_hub_metadata_and_the_two_line_snippet(drafter_dir):
    """pipeline_tag and datasets make the card findable on the Hub; the snippet shows the one call that matters."""
    write_model_card(drafter_dir, base_model="acme/tiny-llama", datasets=["acme/chats"])
    card = ModelCard.load(drafter_dir / "README.md")
    assert card.data.pipeline_tag == "text-generation" and card.data.datasets == ["acme/chats"]
    assert ('drafter = AutoModel.from_pretrained("acme/tiny-llama-eagle3.1-drafter")\n'
            "out = target.generate(**inputs, assistant_model=drafter)\n```") in card.text


def test_shipped_cards_name_their_target_and_the_pipeline():
    """Every shipped drafter card, the demo pair's too (whose target is built in the repository, named by its place)."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    expected = {"smollm2/eagle3": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "smollm2/eagle31": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3/eagle31": "google/gemma-3-270m",
                "demo_pair/eagle3": "examples/demo_pair/target", "demo_pair/eagle31": "examples/demo_pair/target"}
    for folder, base_model in expected.items():
        card = ModelCard.load(examples / folder / "README.md")
        assert card.data.base_model == base_model and card.data.pipeline_tag == "text-generation", folder
        assert "assistant_model=drafter)\n```" in card.text, folder
