"""Tools beside the runner: generated checkpoints (`synth`), the live budget sweep (`sweep`),
the route-log replay (`simulate`), its plots (`benchplot`) and the machine checks behind
`dsv4 doctor` (`doctor`). Nothing on the runtime path imports this package."""
