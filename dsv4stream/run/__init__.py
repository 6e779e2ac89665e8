"""A budgeted run: the plan, what it measures, and what it reports.

`planner` (pure: a `--budget` split into pinned layers, ring, head, expert slots, prefill
segment; each family's state and staging terms from `planner_v4` / `planner_v41`, picked by
`planner.FAMILY_PLANNERS`), `memory` (what the checkpoint needs, peak RSS), `runinfo` (`RunOptions`,
`RunStats`: the store's, ring's and Engram cache's stats and the sessions' phases, nested),
`runtime` (`Runtime`: open under a budget, compile kernels apart, wire streaming into an
`Engine`, generate, the live counters), `report` and `ticker` (what a person sees while and
after it runs).
"""
