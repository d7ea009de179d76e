"""Write a Hub model card (README.md with metadata) for a drafter folder.

`hf-eagle31 card DIR [--base-model ID] [--bench results.json]`; `hf-eagle31 train` writes one too.
The card states what a user must know to pick a drafter: which target it serves, the EAGLE-3 /
3.1 switches, the target layers it reads, its draft vocabulary, how it was trained (from the
`training_args.json` that training leaves in the folder) and, given benchmark results, the
measured acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from hf_eagle31.configuration import Eagle3Config
from hf_eagle31.packaged import hub_id, is_local_path, require_hub_id

TEMPLATE = Path(__file__).with_name("drafter_card_template.md")
HIDDEN_TRAINING_KEYS = {"resume", "feature_cache", "seed"}
LIBRARY = "hf-eagle31"
CARD_MARK = f"library_name: {LIBRARY}"  # in the front matter of every card written here


def _format(value) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def benchmark_rows(results, arch_name: str | None = None) -> list[dict]:
    """Table rows from benchmark results: one run or a list of runs (or `{"runs": [...]}`), each with
    optional `name`, `tau`, `speedup` and per-depth acceptance as `acceptance_per_depth`
    (`SpeculationStats.as_dict()`) or `acceptance` (`AcceptanceReport.as_dict()`); or an
    `hf-eagle31 bench` results.json, whose methods named after `arch_name` ("EAGLE 3.1 tree", ...) are this
    drafter's."""
    if isinstance(results, dict) and "methods" in results:
        runs = [m for m in results["methods"] if arch_name is None or m["name"].startswith(arch_name + " ")]
        if not runs:
            raise ValueError(f"the benchmark results have no {arch_name} method (they have "
                             f"{', '.join(m['name'] for m in results['methods'])})")
    else:
        runs = results.get("runs", [results]) if isinstance(results, dict) else list(results)
    rows = []
    for number, run in enumerate(runs, 1):
        alpha = run.get("acceptance_per_depth", run.get("acceptance"))
        if alpha is None:
            raise ValueError(f"benchmark run {number} has no 'acceptance_per_depth' or 'acceptance' list")
        # a run that measured the best plain decoding too gives both speedups; an older one only over the default
        over_default = run.get("speedup_default", run.get("speedup"))
        rows.append({"name": run.get("name", run.get("mode", f"run {number}")), "tau": _format(run.get("tau")),
                     "speedup": _format(run.get("speedup") if "speedup_default" in run else None),
                     "speedup_default": _format(over_default), "alpha": [_format(float(a)) for a in alpha]})
    depth = max(len(row["alpha"]) for row in rows)
    for row in rows:
        row["alpha"] += ["–"] * (depth - len(row["alpha"]))
    return rows


def _bench_source(results) -> str:
    """Where an `hf-eagle31 bench` results.json came from: date, machine, prompts, command."""
    if not isinstance(results, dict) or "command" not in results:
        return ""
    prompts = results.get("prompts", {})
    count = sum(prompts.values()) if isinstance(prompts, dict) else prompts
    dtype = str(results.get("dtype", "")).removeprefix("torch.")
    return (f"Measured {results.get('date', '')} on {results.get('machine', 'an unrecorded machine')}"
            f"{', ' + dtype if dtype else ''}, {count} prompts, with `{results['command']}`.")


def _weight_bytes(folder: Path) -> str:
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return f"{size / 2**20:.1f} MiB" if size else "–"


def write_model_card(
    drafter_dir: str | Path,
    base_model: str | None = None,
    training: dict | None = None,
    benchmark: str | Path | dict | list | None = None,
    license: str = "apache-2.0",
    local_base_model: bool = False,
    datasets: list[str] | None = None,
    overwrite: bool = False,
) -> ModelCard:
    """Write `drafter_dir/README.md` and return the card. A README.md this package did not write is kept, and
    refused, unless `overwrite`; a folder that holds no saved drafter is refused by name.

    Args:
        base_model: the target's Hub id (metadata `base_model`; a packaged model's name or cache folder becomes its
            Hub id); defaults to the target recorded in `training_args.json` when that is a Hub id.
        training: facts about training; defaults to `drafter_dir/training_args.json` when present.
        benchmark: results (or a JSON file of them) for the acceptance table, see `benchmark_rows`.
        license: set it to the target's license when that differs.
        local_base_model: write a `base_model` that is not a Hub id as given (a folder other machines lack).
        datasets: Hub ids of the datasets the training prompts came from (metadata `datasets`).
        overwrite: replace a README.md that this package did not write.
    """
    folder = Path(drafter_dir)
    config = saved_drafter_config(folder, overwrite)
    args_file = folder / "training_args.json"
    if training is None and args_file.exists():
        training = json.loads(args_file.read_text())
    if base_model is None and training:
        base_model = hub_id(str(training.get("target", "")))
    elif base_model is not None and not local_base_model:
        base_model = require_hub_id(base_model, "the card's base_model", "--local-base-model (local_base_model=True)")
    if isinstance(benchmark, (str, Path)):
        try:
            benchmark = json.loads(Path(benchmark).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read benchmark results {benchmark}: {err}") from None
    eagle31 = config.fc_norm or config.norm_output
    rows = benchmark_rows(benchmark, "EAGLE 3.1" if eagle31 else "EAGLE-3") if benchmark is not None else None
    arch_tag = "eagle3.1" if eagle31 else "eagle3"
    linked = base_model is not None and not is_local_path(base_model)  # a Hub id: a link, and the drafter's repo
    card_data = ModelCardData(
        library_name=LIBRARY,
        pipeline_tag="text-generation",
        base_model=base_model,
        datasets=datasets or None,
        license=license,
        tags=["speculative-decoding", "eagle", arch_tag, "hf-eagle31", "transformers"],
    )
    card = ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        title=f"{'EAGLE 3.1' if eagle31 else 'EAGLE-3'} drafter{f' for {base_model}' if base_model else ''}",
        arch_name="EAGLE 3.1" if eagle31 else "EAGLE-3",
        base_model=base_model,
        base_link=linked,
        repo_hint=f"{base_model}-{arch_tag}-drafter" if linked else str(folder),
        config=config,
        weight_bytes=_weight_bytes(folder),
        training={k: f"{v:.4g}" if isinstance(v, float) else str(v)  # a learning rate of 5e-4 stays 0.0005
                  for k, v in (training or {}).items() if k not in HIDDEN_TRAINING_KEYS and v is not None},
        benchmark=rows,
        bench_source=_bench_source(benchmark),
        depths=len(rows[0]["alpha"]) if rows else 0,
    )
    card.save(folder / "README.md")
    return card


def saved_drafter_config(folder: Path, overwrite: bool) -> Eagle3Config:
    """The config of the drafter saved in `folder`, refused by name where the folder holds none, or no weights, or
    a README.md this package did not write (unless `overwrite`)."""
    try:
        if not (folder / "config.json").is_file():
            raise OSError("no config.json")
        if json.loads((folder / "config.json").read_text()).get("model_type") != Eagle3Config.model_type:
            raise ValueError(f"its config.json is not an {Eagle3Config.model_type} config (save the drafter with "
                             "save_pretrained, or convert another layout with `hf-eagle31 convert`)")
        config = Eagle3Config.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder} does not hold a drafter config: {err}") from None
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} holds no drafter weights (*.safetensors): save the drafter there first")
    readme = folder / "README.md"
    if readme.is_file() and not overwrite and CARD_MARK not in readme.read_text(errors="replace"):
        raise ValueError(f"{readme} was not written by hf-eagle31 and would be replaced: move it, or pass "
                         "--overwrite (overwrite=True) to replace it")
    return config
