"""dslab's dashboard over run reports: a Dash app (:mod:`dashboards.app`) and static PNG figures
for CI artifacts (:mod:`dashboards.plots`).

Everything here reads saved run reports through :mod:`dslab.report` and nothing else of dslab
(DESIGN.md, layers). :mod:`dashboards.data` finds and caches reports; :mod:`dashboards.views`
(with :mod:`dashboards.experts_view`, :mod:`dashboards.io_view`, :mod:`dashboards.inference` and
:mod:`dashboards.scaling_view`)
turns a report's DataFrames (:mod:`dslab.report.frames`, the one place that knows the report's
layout) into plain tables and series, and the two drawing layers (plotly figures for the app,
matplotlib for the PNGs) draw those same tables, so both show the same numbers. Importing this
package imports neither Dash nor matplotlib.
"""
