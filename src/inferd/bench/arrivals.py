"""Arrival schedules: absolute send offsets (ns from the run's start), computed before the run.

    --request-rate inf                    every request due at 0 (closed loop under --max-concurrency)
    --request-rate R --burstiness 1       Poisson process: exponential gaps of mean 1/R
    --request-rate R --burstiness B       gamma gaps, shape B, mean 1/R (B < 1 burstier, B > 1 steadier)
    --request-rate R --burstiness inf     constant rate: gaps of exactly 1/R
The first request is due at 0; request i at the sum of the first i gaps.
"""
from __future__ import annotations

import math
import random


def arrival_offsets_ns(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[int]:
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0] * n
    if not rate > 0 or not burstiness > 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(f"arrivals:{seed}")
    out, t = [0], 0.0
    for _ in range(n - 1):
        if math.isinf(burstiness):
            gap = 1.0 / rate
        else:
            gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        t += gap
        out.append(int(round(t * 1e9)))
    return out
