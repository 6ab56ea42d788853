"""What failure costs at scale: the mean time between a job's interruptions, Young's and
Daly's checkpoint interval, and the share of a run's time that trains (goodput).

Llama 3 405B's pre-training (Llama 3 paper, section 3.3.4, Table 5): 466 job
interruptions in a 54-day snapshot on up to 16,384 H100 GPUs, 419 of them unexpected,
about 78 % of those confirmed or suspected hardware; over 90 % effective training time.
"""
from __future__ import annotations

import math
import random

LLAMA3 = {"gpus": 16384, "days": 54, "interruptions": 466, "unexpected": 419,
          "hardware_share": 0.78, "effective_time": 0.90}


def mtbf_s(days: float, interruptions: int) -> float:
    """Mean seconds between a job's interruptions over ``days``."""
    if interruptions < 1 or days <= 0:
        raise ValueError("need a positive number of days and at least one interruption")
    return days * 86400 / interruptions


def young_interval(checkpoint_s: float, mtbf: float) -> float:
    """Young (1974): the interval between checkpoints that loses the least, √(2·δ·M) for a
    checkpoint of δ seconds and a mean time M between failures (first order in δ/M)."""
    return math.sqrt(2 * checkpoint_s * mtbf)


def daly_interval(checkpoint_s: float, mtbf: float) -> float:
    """Daly (2006, eq. 37): Young's interval with its higher-order terms,
    √(2δM)·(1 + ⅓·√(δ/2M) + δ/(18M)) − δ for δ < 2M, else M."""
    if checkpoint_s >= 2 * mtbf:
        return mtbf
    r = checkpoint_s / (2 * mtbf)
    return math.sqrt(2 * checkpoint_s * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - checkpoint_s


def goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf: float) -> float:
    """The share of wall time that trains, to first order: each interval τ of work pays a
    checkpoint δ, and each failure (one per M seconds) costs a restart R and, on average,
    half an interval and checkpoint of work redone: τ/(τ+δ) · (1 − (R + (τ+δ)/2)/M)."""
    return interval_s / (interval_s + checkpoint_s) * \
        (1 - (restart_s + (interval_s + checkpoint_s) / 2) / mtbf)


def failure_steps(steps: int, mean_steps: float, seed: int = 0) -> list[int]:
    """Steps at which a run of ``steps`` steps fails, failures arriving as a Poisson
    process of mean ``mean_steps`` steps apart (counted in steps of work done)."""
    rng = random.Random(seed)
    found, at = [], rng.expovariate(1 / mean_steps)
    while at < steps:
        found.append(int(at))
        at += rng.expovariate(1 / mean_steps)
    return found
