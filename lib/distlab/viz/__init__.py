"""Plots (matplotlib) and widgets (ipywidgets) of the labs, one module per subject.

Every widget also renders as a static matplotlib figure, so that a notebook viewed
without a widget front end (GitHub, a static HTML export) still shows a picture.
"""
