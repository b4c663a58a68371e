"""Callbacks for TRACE runs: monitoring (TensorBoard) and the policy's export.

Enable them in a LightningCLI config::

    trainer:
      logger: {class_path: lightning.pytorch.loggers.TensorBoardLogger,
               init_args: {save_dir: runs}}
      callbacks:
        - class_path: callbacks.RewardVariance
        - class_path: callbacks.AllocationSpread
        - class_path: callbacks.QAAccuracy
        - class_path: callbacks.PredictorCalibration
        - class_path: callbacks.TreeSamples
        - class_path: callbacks.Throughput
        - class_path: callbacks.ExportPolicy   # the policy as a Hugging Face directory
        - class_path: callbacks.RLProgressBar  # reward, effective ratio, held-out accuracy

Every key they log is listed in ``callbacks/METRICS.md``.
"""

from callbacks.allocation_spread import AllocationSpread
from callbacks.export_policy import ExportPolicy
from callbacks.predictor_calibration import PredictorCalibration
from callbacks.qa_accuracy import QAAccuracy
from callbacks.progress import RLProgressBar
from callbacks.reward_variance import RewardVariance
from callbacks.throughput import Throughput
from callbacks.tree_samples import TreeSamples

__all__ = ["AllocationSpread", "ExportPolicy", "PredictorCalibration", "QAAccuracy",
           "RLProgressBar", "RewardVariance", "Throughput", "TreeSamples"]
