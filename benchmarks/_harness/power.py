"""Power of a paired, two-sided t test: the chance to detect an effect, and the seeds that need.

A confirmatory study tests each hypothesis with a paired t test on per-seed differences at
Holm's level; planning takes its hardest step, the Bonferroni level ``alpha / m`` of a family
of ``m``. With ``n`` seeds, differences of mean ``effect`` and standard deviation ``sd`` give
the statistic a noncentral t distribution (``n - 1`` degrees of freedom, noncentrality
``|effect| / sd * sqrt(n)``). Its tails are integrated here over the chi-square variable
directly: scipy's ``nct`` returns NaN for the large noncentralities of strong effects.
"""

from __future__ import annotations

import math

from scipy import integrate, optimize, stats


def paired_t_power(effect: float, sd: float, seeds: int, alpha: float) -> float:
    """The chance that a two-sided paired t test at ``alpha`` rejects, given the true effect.

    Args:
        effect: the mean of the per-seed differences (any sign; the test is two-sided).
        sd: their standard deviation (> 0).
        seeds: the number of pairs (>= 2).
        alpha: the test's level, e.g. ``0.05 / 3`` for Holm's first step in a family of three.

    Returns:
        The power, in [alpha, 1].
    """
    if seeds < 2 or not sd > 0 or not 0 < alpha < 1:
        raise ValueError(f"paired_t_power needs seeds >= 2, sd > 0 and 0 < alpha < 1 (got {seeds}, {sd}, {alpha})")
    df = seeds - 1
    shift = abs(effect) / sd * math.sqrt(seeds)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def rejects(chi2: float) -> float:
        # Given the chi-square variable, T = (Z + shift) / s with s = sqrt(chi2 / df): a normal tail each side.
        scaled = critical * math.sqrt(chi2 / df)
        return (stats.norm.sf(scaled - shift) + stats.norm.cdf(-scaled - shift)) * stats.chi2.pdf(chi2, df)

    # The chi-square density's bulk lies within a few df of its mean: split there so quad sees it.
    edge = df + 10 * math.sqrt(2 * df) + 10
    power = integrate.quad(rejects, 0, edge, limit=200)[0] + integrate.quad(rejects, edge, math.inf)[0]
    return min(1.0, max(alpha, power))


def seeds_for_power(effect: float, sd: float, alpha: float, power: float = 0.8, most: int = 1000) -> int | None:
    """The fewest seeds (>= 2) whose paired t test at ``alpha`` reaches ``power``; None past ``most``."""
    if effect == 0:
        return None

    def enough(seeds: int) -> bool:
        return paired_t_power(effect, sd, seeds, alpha) >= power

    # The power grows with the seeds: double until enough, then bisect (a few dozen integrals, not hundreds).
    low, high = 1, 2
    while not enough(high):
        if high >= most:
            return None
        low, high = high, min(2 * high, most)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def detectable_effect(sd: float, seeds: int, alpha: float, power: float = 0.8) -> float:
    """The smallest absolute mean difference that ``seeds`` pairs detect with ``power`` at ``alpha``."""
    high = sd
    while paired_t_power(high, sd, seeds, alpha) < power:
        high *= 2
    return optimize.brentq(lambda effect: paired_t_power(effect, sd, seeds, alpha) - power, 0.0, high, xtol=1e-6)
