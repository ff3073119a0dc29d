"""Choosing each request's next token from its logits, with the request's own options and RNG.

A request's samples do not depend on what it is batched with: equal seeds give equal tokens.
Pipeline and penalties: docs/compute.md."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_REPETITION_PENALTY = 10.0
MAX_PRESENCE_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 0 is read as 1
    seed: int = 0  # 0 = draw a fresh seed
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    repetition_penalty: float = 1.0  # > 0; 1 (or 0, read as 1) = off
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off


def check_sampling(sampling: SamplingParams) -> list[str]:
    """What is wrong with ``sampling``, one message per field naming it and its range."""
    problems = []
    if not (math.isfinite(sampling.temperature) and 0.0 <= sampling.temperature <= MAX_TEMPERATURE):
        problems.append(
            f"sampling.temperature {sampling.temperature} is out of range [0, {MAX_TEMPERATURE:g}]"
        )
    if not (math.isfinite(sampling.top_p) and 0.0 <= sampling.top_p <= 1.0):
        problems.append(f"sampling.top_p {sampling.top_p} is out of range (0, 1] (0 means 1)")
    if not 0 <= sampling.top_k <= MAX_TOP_K:
        problems.append(f"sampling.top_k {sampling.top_k} is out of range [0, {MAX_TOP_K}] (0 means all)")
    rp = sampling.repetition_penalty
    if not (math.isfinite(rp) and 0.0 <= rp <= MAX_REPETITION_PENALTY):
        problems.append(
            f"sampling.repetition_penalty {rp} is out of range (0, {MAX_REPETITION_PENALTY:g}] (0 means 1, off)"
        )
    pp = sampling.presence_penalty
    if not (math.isfinite(pp) and -MAX_PRESENCE_PENALTY <= pp <= MAX_PRESENCE_PENALTY):
        problems.append(
            f"sampling.presence_penalty {pp} is out of range [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}]"
        )
    return problems


class Sampler:
    """One request's token choice: its options, its RNG and the tokens it has seen."""

    def __init__(
        self, sampling: SamplingParams, prompt_ids: tuple[int, ...], vocab_size: int, device: torch.device
    ):
        self.temperature = sampling.temperature
        self.top_p = sampling.top_p or 1.0
        self.top_k = sampling.top_k
        self.repetition_penalty = sampling.repetition_penalty or 1.0
        self.presence_penalty = sampling.presence_penalty
        self.generator: torch.Generator | None = None
        if self.temperature > 0:
            seed = sampling.seed or secrets.randbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self._vocab = vocab_size
        self._device = device
        # Tokens seen (prompt + output) and generated (output only), as index tensors for the
        # penalties; kept only when a penalty needs them.
        self._seen: set[int] = set(prompt_ids) if self.repetition_penalty != 1.0 else set()
        self._generated: set[int] = set()

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def penalised(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] → float32 logits with this request's penalties applied (a copy if any)."""
        logits = logits.float()
        repeat = self.repetition_penalty != 1.0 and self._seen
        presence = self.presence_penalty != 0.0 and self._generated
        if not (repeat or presence):
            return logits
        logits = logits.clone()
        if repeat:
            idx = torch.tensor(sorted(self._seen), dtype=torch.long, device=logits.device)
            picked = logits[idx]
            logits[idx] = torch.where(
                picked > 0, picked / self.repetition_penalty, picked * self.repetition_penalty
            )
        if presence:
            idx = torch.tensor(sorted(self._generated), dtype=torch.long, device=logits.device)
            logits[idx] -= self.presence_penalty
        return logits

    def pick(self, logits: torch.Tensor, want_logprob: bool = False) -> tuple[int, float | None]:
        """logits [V] → (token id, its log-probability when asked). Remembers the token."""
        logits = self.penalised(logits)
        if self.generator is None:
            token = int(torch.argmax(logits))
            scaled = logits
        else:
            scaled = logits / self.temperature
            probs = torch.softmax(scaled, dim=-1)  # [V] float32
            if self.top_k and self.top_k < probs.shape[0]:
                kth = torch.topk(probs, self.top_k).values[-1]
                probs = probs.masked_fill(probs < kth, 0.0)
                probs = probs / probs.sum()  # top-p then counts mass among the top k
            if self.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V] int64
                # Drop a token when the mass before it already reaches top_p (the first always stays).
                drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        logprob = float(torch.log_softmax(scaled, dim=-1)[token]) if want_logprob else None
        self.remember(token)
        return token, logprob

    def remember(self, token: int) -> None:
        if self.repetition_penalty != 1.0:
            self._seen.add(token)
        if self.presence_penalty != 0.0:
            self._generated.add(token)
