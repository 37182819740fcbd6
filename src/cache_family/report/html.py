"""``report.html``: the run report's Markdown as one self-contained page.

The Markdown is the single source of the tables. No script and no external resource: a content
security policy forbids any fetch, so the page opens offline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from html import escape
from typing import Final

_CODE_SPAN: Final = re.compile(r"`([^`]*)`")
_BOLD: Final = re.compile(r"\*\*(.+?)\*\*")
_LINK: Final = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_IMAGE: Final = re.compile(r"^!\[([^\]]*)\]\(([^)\s]+)\)$")
_SUMMARY: Final = re.compile(r"^<summary>(.*)</summary>$")
#: Only relative, percent-encoded links (the run's files, anchors) become links: no scheme.
_SAFE_HREF: Final = re.compile(r"^(?:[A-Za-z0-9._~%-]+/)*[A-Za-z0-9._~%-]*(?:#[A-Za-z0-9_-]+)?$")

STYLE: Final = """
body { font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 78rem;
  padding: 0 1rem; color: #1b1b1b; line-height: 1.4; overflow-wrap: break-word; }
details { margin: 0.4rem 0 1rem; } summary { cursor: pointer; color: #1f4e8c; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.3rem; margin-top: 2rem; }
h3 { font-size: 1.1rem; margin-top: 1.5rem; }
.table { overflow-x: auto; margin: 0.6rem 0 1rem; }
table { border-collapse: collapse; font-size: 0.85rem; width: max-content;
  max-width: max(100%, 60rem); }
th, td { border: 1px solid #c8c8c8; padding: 0.25rem 0.5rem; vertical-align: top; }
td:first-child { white-space: nowrap; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code { font-size: 0.85em; background: #f4f4f4; padding: 0 0.2em; }
.banner { border: 2px solid #b45309; background: #fff4e0; color: #7c2d12; font-weight: bold;
  padding: 0.6rem 0.9rem; margin: 1rem 0; }
figure { margin: 0.5rem 0 1.2rem; } svg { max-width: 100%; height: auto; }
"""
CSP: Final = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _inline_plain(text: str) -> str:
    out = escape(text, quote=False)
    out = _BOLD.sub(r"<strong>\1</strong>", out)

    def link(match: re.Match[str]) -> str:
        label, href = match.group(1), match.group(2)
        if not _SAFE_HREF.match(href):
            return match.group(0)
        return f'<a href="{escape(href)}">{label}</a>'

    return _LINK.sub(link, out)


def inline(text: str) -> str:
    """One line of Markdown as HTML: code spans verbatim (escaped), then bold and links."""
    parts: list[str] = []
    last = 0
    for match in _CODE_SPAN.finditer(text):
        parts.append(_inline_plain(text[last : match.start()]))
        parts.append(f"<code>{escape(match.group(1), quote=False)}</code>")
        last = match.end()
    parts.append(_inline_plain(text[last:]))
    return "".join(parts)


def _cells(line: str) -> list[str]:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") else inner
    return [c.strip() for c in inner.split("|")]


def _table(lines: list[str]) -> str:
    header = _cells(lines[0])
    aligns = _cells(lines[1]) if len(lines) > 1 else []
    right = [a.endswith(":") for a in aligns]
    out = ['<div class="table"><table>', "<thead><tr>"]
    out.extend(f"<th>{inline(h)}</th>" for h in header)
    out.append("</tr></thead>")
    out.append("<tbody>")
    for line in lines[2:]:
        cols = _cells(line)
        out.append(
            "<tr>"
            + "".join(
                f'<td class="num">{inline(c)}</td>'
                if k < len(right) and right[k]
                else f"<td>{inline(c)}</td>"
                for k, c in enumerate(cols)
            )
            + "</tr>"
        )
    out.append("</tbody></table></div>")
    return "\n".join(out)


def anchor(text: str) -> str:
    """The id a heading of ``text`` gets (as GitHub spells it: lower case, spaces to ``-``,
    other punctuation dropped), so ``[...](#id)`` links work in the page and the Markdown."""
    kept = re.sub(r"[^\w\- ]", "", text.strip().lower(), flags=re.ASCII)
    return kept.replace(" ", "-")


def markdown_to_html(markdown: str, title: str, svgs: Mapping[str, str]) -> str:
    """A whole HTML page for ``markdown``; an image line whose target is a key of ``svgs``
    is replaced by that SVG, inline. Headings get ids (:func:`anchor`); the lines
    ``<details>``, ``<summary>TEXT</summary>`` and ``</details>`` fold what is between them."""
    body: list[str] = []
    lines = markdown.split("\n")
    i = 0
    paragraph: list[str] = []
    ids: set[str] = set()

    def flush() -> None:
        if paragraph:
            body.append("<p>" + inline(" ".join(paragraph)) + "</p>")
            paragraph.clear()

    while i < len(lines):
        line = lines[i]
        heading = re.match(r"^(#{1,6}) (.*)$", line)
        image = _IMAGE.match(line)
        summary = _SUMMARY.match(line)
        if not line.strip() or line.startswith("<!--"):
            flush()
        elif heading:
            flush()
            level = len(heading.group(1))
            ident = anchor(heading.group(2)) or "section"
            while ident in ids:
                ident += "-1"
            ids.add(ident)
            body.append(f'<h{level} id="{ident}">{inline(heading.group(2))}</h{level}>')
        elif line in ("<details>", "</details>"):
            flush()
            body.append(line)
        elif summary:
            flush()
            body.append(f"<summary>{inline(summary.group(1))}</summary>")
        elif line.startswith("|"):
            flush()
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            body.append(_table(block))
            continue
        elif line.startswith("> "):
            flush()
            body.append(f'<div class="banner">{inline(line[2:])}</div>')
        elif line.startswith("- "):
            flush()
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{inline(lines[i][2:])}</li>")
                i += 1
            body.append("<ul>\n" + "\n".join(items) + "\n</ul>")
            continue
        elif image and image.group(2) in svgs:
            flush()
            link = image.group(2)
            body.append(
                f'<figure>{svgs[link]}<figcaption><a href="{escape(link)}">'
                f"{escape(image.group(1), quote=False)}</a></figcaption></figure>"
            )
        else:
            paragraph.append(line)
        i += 1
    flush()
    head = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title, quote=False)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
    )
    return head + "\n".join(body) + "\n</body>\n</html>\n"
