"""``miles view RUN_DIR``: one static HTML file that shows what a run did, step by step.

The page is self-contained (inline CSS, inline SVG, one small inline script; nothing fetched), so
it opens from disk, from a CI artifact or from a mail. Its Content-Security-Policy allows no
network and only the page's own script (by hash): even if some dumped text got past the escaping,
it could not load or run anything. Modules: :mod:`~miles.view.run_folder` (what is read),
:mod:`~miles.view.tokens` (ids to text, split by loss mask), :mod:`~miles.view.episode` (branch
trees), :mod:`~miles.view.curves` (SVG charts), :mod:`~miles.view.page` (the document).
"""

from miles.view.page import ViewLimits, write_report

__all__ = ["ViewLimits", "write_report"]
