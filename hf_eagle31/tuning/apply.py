"""Applying a tuning: the chosen shapes stored in the drafter's generation config (and its folder), and the entry
points that measure, predict and store in one call (`tune_drafter`, `tune_batch_sizes`, `tune_sampling`,
`retune_folder`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_eagle31.generation import drafting_dtype, prepare_drafter
from hf_eagle31.modeling import Eagle3DraftModel
from hf_eagle31.tuning.measure import BATCH_SIZES, batch_costs, calibrate_families, choose_tree_shape, settings_of
from hf_eagle31.tuning.predict import TuningReport, batch_shapes, report_cpu_backend, sampling_tuning

SAMPLING_TEMPERATURE = 1.0  # the temperature `sampling_shape` is calibrated at; it serves every sampling call


def apply_choice(drafter: Eagle3DraftModel, report: TuningReport | dict) -> None:
    """Store the best chain length, the best tree, the faster mode and the verify path they were measured on
    (`cpu_backend`) in the drafter's generation config, the shape predicted fastest for each batch size
    (`batch_shapes`) and for sampling (`sampling_shape`).

    `report` may also be a saved `TuningReport.as_dict()` (a resumed benchmark reuses its tuning).
    Where the device replays static drafts, tuning timed both drafting modes and the faster one is stored
    (`draft_mode`). Dynamic speculation is switched off: the shapes were chosen for the acceptance measured at a
    fixed depth, and the PID controller, shortening drafts after each miss, then costs some of the tuned shape's
    speed (docs/benchmarks.md).
    """
    if isinstance(report, TuningReport):
        report = report.as_dict()
    chain, tree, choice = report["best_chain"], report["best_tree"], report["choice"]
    config = drafter.generation_config
    if chain:
        config.num_assistant_tokens = chain["tree_depth"]
    if tree:
        config.update(tree_top_k=tree["tree_top_k"], tree_depth=tree["tree_depth"],
                      tree_total_tokens=tree["tree_total_tokens"])
    config.max_speculation_depth = max(chain.get("tree_depth", 1), tree.get("tree_depth", 1))
    config.speculation_mode = "chain" if choice["tree_top_k"] == 1 else "tree"
    config.dynamic_speculation = False
    cpu_backend = report_cpu_backend(report)
    if cpu_backend is not None:  # None: a report from before tuning chose the path, measured on the CPU backend
        config.cpu_backend = cpu_backend  # where it could: the drafter's setting kept
    if "draft_mode" in choice:  # timed both ways where the device replays static drafts
        config.draft_mode = choice["draft_mode"]
    config.batch_shapes = batch_shapes(report) if report.get("batch_costs") else None
    config.sampling_shape = (report.get("sampling") or {}).get("shape")
    settings_of(drafter)  # what was stored is checked as every call checks it


BATCH_MAX_DEPTH = 8  # the deepest batched draft timed: deeper ones did not pay at a batch size above one


def tune_drafter(target: PreTrainedModel, drafter: Eagle3DraftModel, prompts: list[torch.Tensor],
                 max_new_tokens: int = 96, top_ks: tuple[int, ...] = (1, 3, 10), max_depth: int = 12,
                 max_tokens: int = 64, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 sampling_temperature: float | None = SAMPLING_TEMPERATURE) -> TuningReport:
    """Calibrate on `prompts` (token ids), measure this device's costs, choose a shape and apply it; the same for
    each of `batch_sizes` (their shapes go to `batch_shapes`) and, calibrated again sampling at
    `sampling_temperature` (None: not), for sampling (`sampling_shape`)."""
    ranks, frontier = calibrate_families(target, drafter, prompts, max_new_tokens, top_ks, max_depth, max_tokens)
    report = choose_tree_shape(target, drafter, ranks, max_depth, max_tokens, frontier_by_top_k=frontier)
    if batch_sizes:
        report.batch_costs = batch_costs(target, drafter, list(top_ks), min(max_depth, BATCH_MAX_DEPTH), batch_sizes,
                                         cpu_backend=report.cpu_backend)
    if sampling_temperature is not None:  # the same costs, the acceptance of sampling
        report.sampling = tune_sampling(target, drafter, report.as_dict(), prompts, max_new_tokens,
                                        sampling_temperature)["sampling"]
    apply_choice(drafter, report)
    return report


def _families(report: dict) -> list[int]:
    """The top_k values a saved report calibrated."""
    return sorted({c["tree_top_k"] for c in report["candidates"]})


def tune_batch_sizes(target: PreTrainedModel, drafter: Eagle3DraftModel, report: dict,
                     batch_sizes: tuple[int, ...] = BATCH_SIZES) -> dict:
    """Add batched costs to a saved tuning report (its calibrated acceptance kept) and store `batch_shapes`."""
    report = {**report, "batch_costs": batch_costs(target, drafter, _families(report), BATCH_MAX_DEPTH, batch_sizes,
                                                   cpu_backend=report_cpu_backend(report))}  # None: the drafter's
    drafter.generation_config.batch_shapes = batch_shapes(report)
    return report


def tune_sampling(target: PreTrainedModel, drafter: Eagle3DraftModel, report: dict, prompts: list[torch.Tensor],
                  max_new_tokens: int = 96, temperature: float = SAMPLING_TEMPERATURE) -> dict:
    """Add the acceptance of sampling at `temperature` to a saved tuning report (its costs kept: nothing is timed,
    so it may run on a busy machine) and store `sampling_shape`."""
    depths = report["draft_seconds"]
    top_ks = _families(report)
    max_depth = max(int(d) for d in depths[next(iter(depths))])
    max_tokens = max(int(n) for n in report["verify_seconds"]) - 1
    sampled, frontier = calibrate_families(target, drafter, prompts, max_new_tokens, top_ks, max_depth, max_tokens,
                                           temperature)
    report = {**report, "sampling": sampling_tuning(report, sampled, temperature, frontier)}
    drafter.generation_config.sampling_shape = report["sampling"]["shape"]
    return report


def retune_folder(target: PreTrainedModel, folder: Path, prompts: list[torch.Tensor], sampling_only: bool = False) -> dict:
    """Re-tune a saved drafter's shapes on this machine, in place (`generation_config.json`, `tuning.json`), as
    decoding runs it (drafting dtype, the target's embedding). The costs are timings: a quiet machine's job, unless
    `sampling_only`, which keeps the saved costs and greedy shapes and calibrates the shape for sampling alone."""
    drafter = Eagle3DraftModel.from_pretrained(folder, dtype=drafting_dtype(target)).eval()
    prepare_drafter(target, drafter)
    if sampling_only:
        report = tune_sampling(target, drafter, json.loads((folder / "tuning.json").read_text()), prompts)
    else:
        report = tune_drafter(target, drafter, prompts).as_dict()
    drafter.generation_config.save_pretrained(folder)
    (folder / "tuning.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report
