"""Text tables and self-contained HTML pages for the debug tools.

An HTML page is one file: tables as ``<table>``, plots as inline SVG drawn
by matplotlib (imported only here, when a page is written: ``pip install
fxq[debug]``), no script and no link to the network, so it opens anywhere.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

__all__ = ["fmt", "text_table", "write_text", "HtmlPage", "figure", "svg_of"]


def fmt(value: Any) -> str:
    """A table cell: floats with 6 significant digits, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.6g}"
    return str(value)


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` (dicts) as a tabulate table with ``columns``."""
    return tabulate([[fmt(r.get(c)) for c in columns] for r in rows], headers=list(columns))


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def _matplotlib_figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "writing HTML reports needs matplotlib: pip install 'fxq[debug]' (or pip install "
            "matplotlib), or pass out_dir=None to get the rows only"
        ) from None
    return Figure(figsize=(width, height), layout="constrained")


def figure(width: float = 8.0, height: float = 3.2) -> Any:
    """A new matplotlib ``Figure`` (no pyplot, no global backend)."""
    return _matplotlib_figure(width, height)


def svg_of(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element (the XML prologue dropped)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg") :]


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #eee; } td:first-child, td:nth-child(2) { text-align: left; }
tr.worst td { background: #fdd; }
figure { margin: 0 0 1.5em 0; } figcaption { font-size: 0.85em; color: #555; }
"""


class HtmlPage:
    """One self-contained HTML page built section by section.

    >>> page = HtmlPage("demo")
    >>> page.table("t", ["a", "b"], [{"a": 1, "b": 2.5}])
    >>> "<td>2.5</td>" in page.html()
    True
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def link(self, href: str, text: str) -> None:
        self.parts.append(f'<p><a href="{html.escape(href)}">{html.escape(text)}</a></p>')

    def table(
        self,
        table_id: str,
        columns: Sequence[str],
        rows: Sequence[dict[str, Any]],
        marked: set[int] | None = None,
    ) -> None:
        """A table with one ``<tr>`` per row; rows whose index is in ``marked`` are highlighted."""
        marked = marked or set()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = []
        for i, r in enumerate(rows):
            cls = ' class="worst"' if i in marked else ""
            cells = "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in columns)
            body.append(f"<tr{cls}>{cells}</tr>")
        self.parts.append(
            f'<table id="{html.escape(table_id)}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>"
        )

    def figure(self, fig: Any, caption: str, figure_id: str = "") -> None:
        """An inline SVG plot with a caption."""
        ident = f' id="{html.escape(figure_id)}"' if figure_id else ""
        self.parts.append(
            f"<figure{ident}>{svg_of(fig)}<figcaption>{html.escape(caption)}</figcaption></figure>"
        )

    def html(self) -> str:
        return (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>" + "\n".join(self.parts) + "</body></html>\n"
        )

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path
