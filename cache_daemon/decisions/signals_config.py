"""Tuning of ``ActivationSignals`` (``SignalsConfig``), apart so that the signals' read side
(``use_estimates``) and its inputs (``signals``) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SignalsConfig:
    """Tuning of ``ActivationSignals``; few and generic on purpose (no per-trace constants)."""

    history_half_life_tokens: float = field(default=4.0, metadata={"min": 0.05, "max": 1e6})
    """Half-life, in tokens, of a request's short recency-weighted use estimate of an entry: after
    ``h`` tokens without use an entry's estimate halves (recency and in-request frequency at
    once; swept on a tuning window separate from the reported one, bench/replay_tune.py)."""

    long_history_half_life_tokens: float = field(default=32.0, metadata={"min": 0.05, "max": 1e6})
    """Half-life, in tokens, of the request's long use estimate, blended with the short one."""

    long_history_weight: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Weight of the long estimate in a request's history (0: the short one alone)."""

    transition_weight: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
    """Weight of the next-visit estimate (the learned ``next_visit.NextVisitModel`` when there is
    one, else the routing transitions of ``transitions.TransitionModel``: what a layer routes at
    its next visit given what it routed at its last) in the probability of use at a layer's next
    visit; the rest is the history's. 0 turns both off."""

    transition_prior_count: float = field(default=4.0, metadata={"min": 1e-3, "max": 1e9})
    """Pseudo-visits at the base rate behind each learned transition (an unseen pair says nothing)."""

    transition_history_exponent: float = field(default=0.25, metadata={"min": 0.0, "max": 16.0})
    """Weight of the request's own history, as a soft prior, in the transition estimate."""

    transition_half_life_visits: float = field(default=4096.0, metadata={"min": 1.0, "max": 1e12})
    """Half-life, in visits of a layer, of its transition counts (learned across requests)."""

    prior_half_life_tokens: float = field(default=2000.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in tokens, of the slow cross-request estimate a new request starts from."""

    prior_weight: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Weight of the cross-request estimate in the history of a request that just began (it then
    decays with the request's own half-life as the request's routing accumulates)."""

    hint_weight: float = field(default=0.3, metadata={"min": 0.0, "max": 1.0})
    """Weight of a fresh EAMC hint score blended into the history estimate."""

    hint_ttl_tokens: int = field(default=64, metadata={"min": 0, "max": 1 << 30})
    """Hints older than this many tokens are ignored (stale)."""

    lookahead_prior_precision: float = field(default=0.8, metadata={"min": 0.0, "max": 1.0})
    """Precision assumed for a lookahead depth before any of its predictions was scored: above
    the scheduler's default bar ``min_probability`` (0.7), so that a new depth is tried and then kept
    or cut by what it measures (a depth's predictions are scored whether or not it is prefetched,
    so under a higher bar it starts cut and is taken up once it measures above it)."""

    precision_half_life: float = field(default=64.0, metadata={"min": 1.0, "max": 1e9})
    """Half-life, in scored predictions, of each depth's running precision estimate."""

    eviction_horizon_tokens: float = field(default=2.0, metadata={"min": 0.05, "max": 1e6})
    """Horizon, in tokens, over which the activation-aware policy weighs each resident entry's
    chance of being used: the entry likeliest to go unused over the next ``horizon * M`` layer
    steps leaves first. On the tuning window of the shared trace at 25% (``bench.replay_tune
    --depths 0 --min-probabilities 0.7 --signals eviction_horizon_tokens=1,1.5,2,3,4,8``, requests
    32..35, Belady 207.4 MiB a token) horizons 1 / 1.5 / 2 / 3 / 4 / 8 load 350.5 / 346.8 / 346.9
    / 348.7 / 351.0 / 355.1 MiB a token."""

    probability_floor: float = field(default=1e-3, metadata={"min": 1e-9, "max": 1.0})
    """Lower bound on a long-run use probability (keeps next-use estimates finite)."""

    max_live_requests: int = field(default=256, metadata={"min": 1, "max": 1 << 20})
    """Live requests kept; beyond it the least recently observed one is dropped (its end was
    lost)."""

    def __post_init__(self) -> None:
        for name, spec in self.__dataclass_fields__.items():
            value = getattr(self, name)
            lo, hi = spec.metadata["min"], spec.metadata["max"]
            if not (lo <= value <= hi):
                raise ValueError(f"SignalsConfig.{name} must be in [{lo}, {hi}], got {value!r}")


__all__ = ["SignalsConfig"]
