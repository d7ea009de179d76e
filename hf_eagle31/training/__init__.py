"""Training EAGLE-3 / EAGLE 3.1 drafters: self-distillation with training-time test (`train_drafter`),
and teacher-forced per-depth acceptance (`evaluate_acceptance`)."""

from hf_eagle31.training.evaluation import AcceptanceReport, evaluate_acceptance
from hf_eagle31.training.trainer import TrainingConfig, drafter_config_for, train_drafter

__all__ = ["AcceptanceReport", "TrainingConfig", "drafter_config_for", "evaluate_acceptance", "train_drafter"]
