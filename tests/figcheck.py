"""Checks on a rendered report figure that a reader would otherwise catch by eye: labels printed over each other."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from matplotlib.text import Annotation

from benchctl.report.figures import renderer_of, text_boxes


def labels(fig: Any) -> list[str]:
    """The texts of the figure's annotations (the point labels), in the order they were placed."""
    return [t.get_text() for ax in fig.axes for t in ax.texts if isinstance(t, Annotation)]


def overlapping_labels(fig: Any) -> list[tuple[str, str]]:
    """Every pair of texts whose boxes overlap where at least one is an annotation: labels against labels and
    against tick labels, axis labels, titles and legend entries (the figure drawn first, as `save_figure` would)."""
    renderer = renderer_of(fig)
    boxes = text_boxes(fig, renderer)
    return [
        (a.get_text(), b.get_text())
        for (a, ba), (b, bb) in combinations(boxes, 2)
        if (isinstance(a, Annotation) or isinstance(b, Annotation)) and ba.overlaps(bb)
    ]


def outside_figure(fig: Any) -> list[str]:
    """The annotations whose text reaches past the figure's edge (cut off in the PNG)."""
    renderer = renderer_of(fig)
    box = fig.bbox
    return [
        t.get_text()
        for t, b in text_boxes(fig, renderer)
        if isinstance(t, Annotation) and (b.x0 < box.x0 or b.y0 < box.y0 or b.x1 > box.x1 or b.y1 > box.y1)
    ]
