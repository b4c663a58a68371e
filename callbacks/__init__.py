"""Monitoring callbacks for TRACE runs (TensorBoard).

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

Every key they log is listed in ``callbacks/METRICS.md``.
"""

from callbacks.allocation_spread import AllocationSpread
from callbacks.predictor_calibration import PredictorCalibration
from callbacks.qa_accuracy import QAAccuracy
from callbacks.reward_variance import RewardVariance
from callbacks.throughput import Throughput
from callbacks.tree_samples import TreeSamples

__all__ = ["AllocationSpread", "PredictorCalibration", "QAAccuracy", "RewardVariance",
           "Throughput", "TreeSamples"]
