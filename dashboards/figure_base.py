"""What the view modules' figures share: plotly imported only when a figure is drawn (the PNG
figures of :mod:`dashboards.plots` use the same modules' tables without plotly), the house layout,
and the figure that says why there is nothing to draw."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import plotly.graph_objects as go

TEMPLATE = "plotly_white"


def plotly_go():
    """``plotly.graph_objects``, imported on first use."""
    import plotly.graph_objects as go

    return go


def laid_out(fig: go.Figure, title: str, margin: dict, **kwargs) -> go.Figure:
    """``fig`` with ``title``, the house template and ``margin``."""
    fig.update_layout(title=title, template=TEMPLATE, margin=margin, **kwargs)
    return fig


def empty_figure(title: str, message: str, margin: dict) -> go.Figure:
    """A figure with no axes that shows ``message``."""
    fig = plotly_go().Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return laid_out(fig, title, margin, height=260)
