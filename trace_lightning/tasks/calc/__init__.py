"""The calculator agent: generated arithmetic word problems, a safe calculator tool, the
``<calc>``/``<answer>`` format and a warm-started tiny policy (``CalcData``, ``CalcTask``)."""

from trace_lightning.tasks.calc.data import CalcData
from trace_lightning.tasks.calc.evaluator import CalcError, evaluate, format_number
from trace_lightning.tasks.calc.problems import Problem, generate_problems
from trace_lightning.tasks.calc.task import CALC_INSTRUCTION, CalcTask, parse_turn

__all__ = ["CALC_INSTRUCTION", "CalcData", "CalcError", "CalcTask", "Problem", "evaluate",
           "format_number", "generate_problems", "parse_turn"]
