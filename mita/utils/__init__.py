"""Utilities shared by every task: the multiply-accumulate counter."""

from mita.utils.flops import MacCount, count_macs, count_params, mita_core_macs, model_gmacs, register_cost_formula

__all__ = ["MacCount", "count_macs", "count_params", "mita_core_macs", "model_gmacs", "register_cost_formula"]
