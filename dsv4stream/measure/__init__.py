"""Measurements beside the runner: the live budget sweep (`sweep`), the route-log replay
(`simulate`), its plots (`benchplot`) and the machine checks behind `dsv4 doctor` (`doctor`).
Only the `bench` and `doctor` commands import it; the runtime path never does."""
