"""What speculative decoding did in one generation, and summed over a run: the report's figures.

Owns: `SpecCounts` (one `Session.generate`-like call of `engine.speculate`; kept on its `Turn`)
and `SpecCounts.total` (a run's calls summed). Counts: drafted and accepted tokens, the tokens
fed in verification passes and in re-feeds after a rejection, `auto`'s watches (drafts only
compared with the picks, `engine.spec_policy`), the expert bytes read while
decoding, and the time with drafts next to the estimated time without them (tokens picked x the
mean plain cycle's wall time, its one-token pass and its own work around it: what `off` spends a
token; before any plain cycle, the mean one-token pass alone).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    setting: str = "auto"  # "auto" or the fixed N, as given
    cycles: int = 0  # passes that picked tokens: plain one-token steps and verifications
    verify_passes: int = 0  # cycles with at least one draft
    drafted: int = 0
    accepted: int = 0
    verified_tokens: int = 0  # fed in verification passes (the picked token + its drafts)
    refeeds: int = 0  # passes that fed the kept tokens again after a rejection
    refeed_tokens: int = 0
    tokens: int = 0  # tokens picked after the prompt's own (the first)
    seconds: float = 0.0  # every cycle's wall time: drafter, passes, re-feeds, picks
    draft_seconds: float = 0.0
    steps: int = 0  # plain one-token cycles (no draft)
    one_seconds: float = 0.0  # every one-token pass (plain steps, one-token re-feeds)...
    ones: int = 0  # ... and their count
    plain_seconds: float = 0.0  # whole cycles with one token fed and no drafter run...
    plains: int = 0  # ... and their count: the estimate of the time without drafts
    expert_bytes: int = 0  # read from disk while decoding
    lengths: Counter[int] = field(default_factory=Counter)  # draft length -> cycles
    # auto's watches: drafter runs whose drafts were only compared with the next picks, never fed
    watches: int = 0
    watch_drafted: int = 0
    watch_accepted: int = 0  # right before the first wrong one
    remembered_runs: int = 0  # auto: the earlier runs whose figures it started from (0: learned afresh)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification pass gave: its accepted drafts plus the main model's own pick."""
        return (self.accepted + self.verify_passes) / self.verify_passes if self.verify_passes else 0.0

    @property
    def one_token_seconds(self) -> float:
        return self.one_seconds / self.ones if self.ones else 0.0

    @property
    def seconds_without(self) -> float:
        """Estimated decode time without drafts: one plain cycle per token (a one-token pass and
        the cycle's work around it: a pass alone left out about 1 ms of a 31 ms token on
        demo-v41, so a reply that drafted nothing read 4 % slower than its estimate), else one
        measured one-token pass per token (0: none measured)."""
        per = self.plain_seconds / self.plains if self.plains else self.one_token_seconds
        return self.tokens * per

    @property
    def expert_bytes_per_token(self) -> float:
        return self.expert_bytes / self.tokens if self.tokens else 0.0

    @classmethod
    def total(cls, parts: list[SpecCounts]) -> SpecCounts | None:
        if not parts:
            return None
        out = cls(setting=parts[-1].setting)
        for p in parts:
            for name in (
                "cycles", "verify_passes", "drafted", "accepted", "verified_tokens", "refeeds", "refeed_tokens",
                "tokens", "seconds", "draft_seconds", "steps", "one_seconds", "ones", "plain_seconds", "plains",
                "expert_bytes",
                "watches", "watch_drafted", "watch_accepted",
            ):  # fmt: skip
                setattr(out, name, getattr(out, name) + getattr(p, name))
            out.lengths.update(p.lengths)
            out.remembered_runs = max(out.remembered_runs, p.remembered_runs)
        return out

    def as_dict(self) -> dict:
        return {
            "setting": self.setting,
            "acceptance": self.acceptance,
            "mean_accepted_length": self.mean_accepted_length,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "verified_tokens": self.verified_tokens,
            "verify_passes": self.verify_passes,
            "plain_steps": self.steps,
            "refeeds": self.refeeds,
            "refeed_tokens": self.refeed_tokens,
            "tokens": self.tokens,
            "expert_bytes_per_token": self.expert_bytes_per_token,
            "seconds": self.seconds,
            "seconds_without_estimated": self.seconds_without,
            "draft_seconds": self.draft_seconds,
            "one_token_pass_seconds": self.one_token_seconds,
            "draft_lengths": {str(k): v for k, v in sorted(self.lengths.items())},
            "watches": self.watches,
            "watch_drafted_tokens": self.watch_drafted,
            "watch_accepted_tokens": self.watch_accepted,
            "remembered_runs": self.remembered_runs,
        }

    def lines(self) -> list[str]:
        if not self.tokens:
            return [f"speculate {self.setting}: no token after the first"]
        lengths = ", ".join(f"{k}: {v}" for k, v in sorted(self.lengths.items()))
        without = f"{self.seconds_without:.2f} s estimated" if self.ones else "not measured (no one-token pass)"
        watches = (
            f", {self.watches} watches ({self.watch_accepted} of {self.watch_drafted} drafts right)"
            if self.watches
            else ""
        )
        if self.remembered_runs:
            watches += f"; started from what {self.remembered_runs} earlier run(s) measured"
        return [
            (
                f"speculate {self.setting}: acceptance {self.acceptance:.0%} ({self.accepted} of {self.drafted} drafts),"
                f" mean accepted length {self.mean_accepted_length:.2f}, {self.verified_tokens} tokens verified in"
                f" {self.verify_passes} passes, {self.refeeds} re-feeds ({self.refeed_tokens} tokens){watches}"
            ),
            (
                f"speculate: draft lengths {{{lengths}}}; {self.expert_bytes_per_token / 1e6:.2f} MB of experts read"
                f" per token; decode {self.seconds:.2f} s with drafts (drafter {self.draft_seconds:.2f} s), without {without}"
            ),
        ]
