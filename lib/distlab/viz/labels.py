"""Labels inside boxes (a Gantt chart's actions, a timeline's collectives) that are drawn
only where they fit.

Whether a label fits depends on the box's width in pixels, known only once the figure
is laid out and saved (its size, its x limits, the dpi). :class:`BoxLabel` decides when
it is drawn: the first of its texts narrower than its box is drawn, or none. A label
is then never clipped by its box nor spills over the next one, and its font size stays
the one asked for (never shrunk to fit). Importing this module imports matplotlib.
"""
from __future__ import annotations

from matplotlib.text import Text

PAD_PT = 1.5   # room left free each side of a label inside its box, in points


class BoxLabel(Text):
    """A label centred in the box from ``x0`` to ``x1`` (data coordinates) at height
    ``y``: at drawing time, the first of ``texts`` that fits the box's width, or nothing.
    ``shown`` is the text last drawn (None when none fitted)."""

    def __init__(self, x0: float, x1: float, y: float, texts, **kwargs):
        texts = list(texts)
        super().__init__((x0 + x1) / 2, y, texts[0], ha="center", va="center", **kwargs)
        self.span, self.texts, self.shown = (x0, x1), texts, None
        self.set_in_layout(False)    # inside the axes: nothing for tight_layout to make room for

    def box_width_px(self) -> float:
        """The box's width on the canvas, in pixels."""
        y = self.get_position()[1]
        (a, _), (b, _) = self.axes.transData.transform([(self.span[0], y), (self.span[1], y)])
        return abs(b - a)

    def draw(self, renderer) -> None:
        self.shown = None
        if not self.get_visible():
            return
        room = self.box_width_px() - 2 * renderer.points_to_pixels(PAD_PT)
        for text in self.texts:
            if _width(renderer, text, self.get_fontproperties()) <= room:
                self.set_text(text)
                self.shown = text
                super().draw(renderer)
                break
        self.stale = False


_WIDTHS: dict[tuple, float] = {}


def _width(renderer, text: str, font) -> float:
    """``text``'s width in pixels, measured once per text, font and dpi (a chart has
    hundreds of labels, and only a few different texts)."""
    key = (text, hash(font), renderer.dpi)    # the hash of its properties, which may change
    if key not in _WIDTHS:
        _WIDTHS[key] = renderer.get_text_width_height_descent(text, font, ismath=False)[0]
    return _WIDTHS[key]


def box_label(ax, x0: float, x1: float, y: float, texts, **kwargs) -> BoxLabel:
    """Add a :class:`BoxLabel` to ``ax`` (keyword arguments: those of ``Text``)."""
    label = BoxLabel(x0, x1, y, texts, **kwargs)
    ax.add_artist(label)
    return label
