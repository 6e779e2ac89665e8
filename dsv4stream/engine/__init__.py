"""The public API of the forward pass: `Engine` (a loaded model) and `Session` (one sequence).

`session` runs tokens through the layers (prefill in segments, step, the one generation
loop); `phases` is what each generate call spent its time on, recorded by the session as it
goes (prefill, first token, decode steps by phase, sampler); `state` is a session as a value (snapshot, restore, a checked file format) for the
prefix caches; `steps` is the `Stack` protocol each family's `stack_v4` / `stack_v41` implements,
and `family` picks one (`STACKS`). Math lives in `model`, weights arrive through `weights` /
`streaming` providers.
"""

from .session import Engine, Session

__all__ = ["Engine", "Session"]
