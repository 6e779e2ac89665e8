"""A budgeted run: the plan, what it measures, and what it reports.

`planner` (pure: a `--budget` split into pinned layers, ring, head, expert slots, prefill
segment), `memory` (what the checkpoint needs, peak RSS), `runinfo` (`RunOptions`,
`RunStats`), `runtime` (`Runtime`: open under a budget, compile kernels apart, wire streaming
into an `Engine`, generate), `profile` (the per-token decode profile), `report` and `ticker`
(what a person sees while and after it runs).
"""
