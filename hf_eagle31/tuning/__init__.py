"""Hardware-aware speculation size: pick the draft shape that maximises tokens per second here.

    measure.py   times the target's verify forwards, the drafter's trees, packing and batches; calibrates the
                 drafter's acceptance by decoding (runs the models)
    predict.py   the speedup every candidate shape would reach from those costs and that acceptance (pure)
    apply.py     the chosen shapes stored in the drafter's generation config and folder; `tune_drafter` and the
                 other entry points that measure, predict and apply in one call

Each module imports only those listed below it (the import contract in pyproject.toml).
"""

from hf_eagle31.tuning.apply import (
    SAMPLING_TEMPERATURE,
    apply_choice,
    retune_folder,
    tune_batch_sizes,
    tune_drafter,
    tune_sampling,
)
from hf_eagle31.tuning.measure import (
    BATCH_BLOCK_SIZES,
    BATCH_SIZES,
    TUNING_ROUNDS,
    VERIFY_SIZES,
    batch_costs,
    best_of,
    calibrate,
    calibrate_families,
    choose_tree_shape,
    draft_cost,
    packing_cost,
    settings_of,
    speculation_settings,
    target_step,
    verify_cost_curve,
    verify_paths,
)
from hf_eagle31.tuning.predict import (
    CALL_TOKENS,
    TuningReport,
    batch_shapes,
    drafted_levels,
    mean_draft_seconds,
    non_decreasing,
    projected_tau,
    rank_candidates,
    report_cpu_backend,
    sampling_tuning,
    tree_draft_seconds,
)

__all__ = [
    "BATCH_BLOCK_SIZES", "BATCH_SIZES", "CALL_TOKENS", "SAMPLING_TEMPERATURE", "TUNING_ROUNDS", "VERIFY_SIZES",
    "TuningReport", "apply_choice", "batch_costs", "batch_shapes", "best_of", "calibrate", "calibrate_families",
    "choose_tree_shape", "draft_cost", "drafted_levels", "mean_draft_seconds", "non_decreasing", "packing_cost",
    "projected_tau", "rank_candidates", "report_cpu_backend", "retune_folder", "sampling_tuning", "settings_of",
    "speculation_settings", "target_step", "tree_draft_seconds", "tune_batch_sizes", "tune_drafter", "tune_sampling", "verify_cost_curve",
    "verify_paths",
]
