"""The sweep plot renders a real PNG from records like the bench's."""

import pytest

from dsv4stream.errors import UsageError
from dsv4stream.measure.benchplot import plot_sweep

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_live_sweep_records_render_both_panels(tmp_path):
    records = [
        {"budget_gb": 1, "hit_rate": 0.0, "decode_s_per_token": 4.6},
        {"budget_gb": 2, "hit_rate": 0.05, "decode_s_per_token": 4.1},
        {"budget_gb": 4, "hit_rate": 0.31, "decode_s_per_token": 3.0},
        {"budget_gb": 8, "hit_rate": 0.53, "decode_s_per_token": 2.2},
    ]
    out = plot_sweep(records, tmp_path / "sweep.png", threshold=3.4, title="made-up sweep")
    w, h = png_size(out)
    assert out.stat().st_size > 10_000 and (w, h) == (770, 715)


def test_policy_records_render_one_line_each_and_empty_is_refused(tmp_path):
    records = [
        {"slots": s, "policy": p, "hit_rate": r}
        for s, rates in ((100, (0.0, 0.2)), (300, (0.4, 0.6)))
        for p, r in zip(("lru", "belady"), rates)
    ]
    out = plot_sweep(records, tmp_path / "sim.png", x="slots", threshold=258)
    assert png_size(out) == (770, 440)
    with pytest.raises(UsageError, match="nothing to plot"):
        plot_sweep([], tmp_path / "none.png")
