"""Plots (matplotlib) and widgets (ipywidgets) of the labs, one module per subject.

Every widget also renders as a static matplotlib figure, so that a notebook viewed
without a widget front end (GitHub, a static HTML export) still shows a picture.
"""

import io


def png(fig, dpi: int = 100, tight: bool = True) -> bytes:
    """``fig`` as PNG bytes: what a widget shows, and its static fallback. ``tight``
    crops the white margin; without it the picture is the figure's size exactly (a
    widget whose picture keeps its size does not move the page)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    return buf.getvalue()
