"""The watch plots' y labels sit on evenly spaced rows (issue 42: at 80x24 the labels skipped a value
and a point sat on the wrong label's row)."""

from __future__ import annotations

import math
import re

import pytest

from dilococtl.tui.widgets.plots import _figure, build_even


def _labels(text: str) -> list[tuple[int, float]]:
    lines = text.splitlines()
    top = next(i for i, ln in enumerate(lines) if "┌" in ln)
    return [(i - top, float(m.group(1))) for i, ln in enumerate(lines)
            if (m := re.match(r"^\s*(-?[\d.]+)┤", ln))]


@pytest.mark.parametrize("height", [8, 9, 10, 11, 12, 14, 17, 22])
def test_y_labels_are_evenly_spaced_rows_and_values(height):
    xs = list(range(1, 26))
    ys = [4 + 500 / r ** 0.75 for r in xs]  # the perplexity, falling from 504
    fig = _figure(76, height)
    fig.plot(xs, ys, marker="braille")
    fig.title("validation perplexity")
    labels = _labels(build_even(fig, ys))
    assert len(labels) >= 2, labels
    rows = [r for r, _ in labels]
    values = [v for _, v in labels]
    assert len({b - a for a, b in zip(rows, rows[1:], strict=False)}) == 1, labels  # equal rows apart
    steps = [a - b for a, b in zip(values, values[1:], strict=False)]
    assert max(steps) - min(steps) <= 1.0 + 1e-9, labels  # equal values apart (to the printed digit)
    assert values[-1] == pytest.approx(min(ys), abs=0.5)  # the bottom row is the lowest point


def test_efficiency_axis_keeps_0_to_100():
    fig = _figure(60, 12)
    fig.plot([1, 2, 3], [90.0, 86.0, 97.0], marker="braille")
    labels = _labels(build_even(fig, [90.0, 86.0, 97.0], 0.0, 100.0))
    assert labels[-1][1] == 0 and math.isclose(labels[1][1] - labels[0][1], labels[2][1] - labels[1][1])
