"""The pure math of TRACE: allocation solvers, advantages, the loss, calibration.

Plain functions on numbers, lists and tensors: no engine, no vLLM, no Lightning.
"""
