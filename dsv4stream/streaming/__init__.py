"""Streaming weight providers: routed experts from the ExpertStore, dense layers through a ring.

In data-flow order: `layout` (where each trunk group's bytes are, in the packed trunk or the
shards), `reader` (`GroupReader`: a group's aligned windows into a buffer, verified on
request), `ring` (`StreamedTrunk`, the `Trunk` provider: pinned layers and the head resident,
the rest through two slots), `rows` (embedding rows read on demand), `experts`
(`StreamedExperts`, the `Experts` provider over an `ExpertStore`). The split of the budget is
`planner`'s, the run itself `runtime`'s.
"""
