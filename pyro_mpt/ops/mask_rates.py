"""Mask-size schedules, an import path kept for them: they live in
:mod:`pyro_mpt.ops.masks`, beside the masks they size."""

from pyro_mpt.ops.masks import FixedRate, RandomRate, RateSchedule, UniformRate, as_rate_schedule

__all__ = ["FixedRate", "RandomRate", "RateSchedule", "UniformRate", "as_rate_schedule"]
