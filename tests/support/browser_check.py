"""Opens a report page in headless Chromium (tests only): console messages, the DOM, and
whether anything overflows the page at a given window width.

The page itself runs no script (its content security policy forbids any), so the overflow
probe runs in a copy of it: the policy line removed and a script appended that measures the
laid-out page, shown in an iframe of the width asked, and writes what it found into the
framing page's DOM, which ``--dump-dom`` prints.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BROWSER = "chromium"
#: The widths the report must read at: a desktop window and a phone.
WIDTHS = (1400, 420)
#: The tallest whole-page screenshot taken (Chromium's window stays below its limits).
MAX_SHOT_HEIGHT = 16000
#: A per-rung table's first header (both per-rung tables start with the arm).
RUNG_TABLE = "Arm"
#: The most lines of text a row of any table may hold at a desktop width (a long note or
#: model reference wraps; a row of seven lines is a table squeezed into narrow columns).
MOST_LINES = 4

_PROBE = """<script>
(function () {
  var root = document.documentElement, width = root.clientWidth, out = [];
  function clipped(el) {
    for (var p = el.parentElement; p; p = p.parentElement) {
      var o = getComputedStyle(p).overflowX;
      if (o === "auto" || o === "scroll" || o === "hidden") return true;
    }
    return false;
  }
  var all = document.body.getElementsByTagName("*");
  for (var i = 0; i < all.length; i++) {
    var el = all[i], r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > width + 1 && !clipped(el)) {
      out.push(el.tagName.toLowerCase() + ":" + Math.round(r.right));
    }
  }
  var tables = [], boxes = document.querySelectorAll("table");
  for (var t = 0; t < boxes.length; t++) {
    var table = boxes[t], box = table.parentElement, head = table.querySelector("th");
    var lines = 0, tallest = 0, rows = table.querySelectorAll("tbody tr");
    for (var k = 0; k < rows.length; k++) {
      var cells = rows[k].children, first = getComputedStyle(cells[0]);
      var line = parseFloat(first.lineHeight), inner = rows[k].getBoundingClientRect().height
        - parseFloat(first.paddingTop) - parseFloat(first.paddingBottom)
        - parseFloat(first.borderTopWidth);
      tallest = Math.max(tallest, rows[k].getBoundingClientRect().height);
      lines = Math.max(lines, Math.round(inner / line));
    }
    tables.push({head: head ? head.textContent : "", rows: rows.length, lines: lines,
      tallest: Math.round(tallest), scroll: box.scrollWidth, client: box.clientWidth});
  }
  parent.document.body.setAttribute("data-probe", JSON.stringify(
    {scroll: root.scrollWidth, client: width, height: root.scrollHeight,
     offenders: out.slice(0, 10), tables: tables}));
})();
</script>"""
#: Chromium's headless window is at least 500 CSS pixels wide, so the page is measured in an
#: iframe exactly as wide as asked, inside a wider window.
_FRAME = (
    '<!DOCTYPE html><html><head><meta charset="utf-8"></head><body style="margin:0">'
    '<iframe src="{src}" width="{width}" height="1500" style="border:0"></iframe></body></html>'
)


@dataclass(frozen=True)
class Opened:
    console: list[str]
    dom: str
    #: ``{scroll, client, height, offenders, tables}`` measured in the laid-out page (folded
    #: tables unfolded); each table:
    #: ``{head, rows, lines, tallest, scroll, client}``: its first header, its body rows,
    #: the most lines of text a row holds, the tallest row (px), and its box's scroll and
    #: client widths (a box that scrolls sideways has scroll > client).
    layout: dict[str, Any]


def browser() -> str:
    found = shutil.which(BROWSER)
    if found is None:
        pytest.skip(
            "BROWSER TEST SKIPPED: Debian's `chromium` is not installed; `./bootstrap test` "
            "installs it when run as root (apt-get install chromium)"
        )
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def open_page(
    page: Path, width: int, *, screenshot: Path | None = None, full_page: Path | None = None
) -> Opened:
    """The page as Chromium shows it in a window ``width`` pixels wide. ``screenshot``: a
    PNG of its first screen; ``full_page``: a PNG of the whole page exactly ``width`` wide
    (up to :data:`MAX_SHOT_HEIGHT` tall), folded tables unfolded, for a reader to look at."""
    flags = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr"]
    flags += ["--v=0", f"--window-size={width},1600"]
    console: list[str] = []
    if screenshot is not None:
        shot = _run([*flags, f"--screenshot={screenshot}", page.as_uri()])
        console += [line for line in shot.stderr.splitlines() if ":CONSOLE" in line]
    dom = _run([*flags, "--dump-dom", page.as_uri()])
    console += [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    text = page.read_text()
    lines = [line for line in text.splitlines() if "Content-Security-Policy" not in line]
    # Folded tables are measured unfolded, as a reader who opens them sees them.
    probed = "\n".join(lines).replace("<details>", "<details open>")
    probed = probed.replace("</body>", _PROBE + "\n</body>")
    # Beside the page, so its relative links and plots resolve the same way.
    target = page.parent / f"probe-{width}-{page.name}"
    frame = page.parent / f"frame-{width}-{page.name}"
    target.write_text(probed)
    frame.write_text(_FRAME.format(src=target.name, width=width))
    wide = [*flags[:-1], f"--window-size={max(width + 100, 600)},1600"]
    try:
        probe = _run(
            [*wide, "--allow-file-access-from-files", "--virtual-time-budget=5000",
             "--dump-dom", frame.as_uri()]
        )  # fmt: skip
    finally:
        target.unlink()
        frame.unlink()
    console += [line for line in probe.stderr.splitlines() if ":CONSOLE" in line]
    marker = 'data-probe="'
    start = probe.stdout.index(marker) + len(marker)
    raw = probe.stdout[start : probe.stdout.index('"', start)]
    layout = json.loads(raw.replace("&quot;", '"').replace("&amp;", "&"))
    if full_page is not None:
        _shoot_whole(page, text, width, min(int(layout["height"]), MAX_SHOT_HEIGHT), full_page)
    return Opened(console=console, dom=dom.stdout, layout=layout)


def _shoot_whole(page: Path, text: str, width: int, height: int, out: Path) -> None:
    """The page, folds open, in an iframe exactly ``width`` wide and ``height`` tall."""
    shown = page.parent / f"shown-{width}-{page.name}"
    frame = page.parent / f"whole-{width}-{page.name}"
    shown.write_text(text.replace("<details>", "<details open>"))
    frame.write_text(
        _FRAME.format(src=shown.name, width=width).replace('height="1500"', f'height="{height}"')
    )
    flags = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    try:
        _run([*flags, f"--window-size={max(width, 500)},{height}", f"--screenshot={out}",
              frame.as_uri()])  # fmt: skip
    finally:
        shown.unlink()
        frame.unlink()


def png_width(path: Path) -> int:
    """The width of a PNG, from its header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    (width,) = struct.unpack(">I", data[16:20])
    return int(width)


def assert_compact(layout: dict[str, Any], width: int) -> None:
    """Nothing outside a scrolling box sticks out; per-rung rows hold one line; at a desktop
    width no table scrolls sideways and no row is squeezed tall."""
    assert layout["offenders"] == [], layout["offenders"]
    assert layout["scroll"] <= layout["client"], layout
    tables = layout["tables"]
    assert tables
    for table in tables:
        if table["head"] == RUNG_TABLE:
            assert table["lines"] == 1, table
        if width >= 1200:
            assert table["scroll"] <= table["client"], table
            assert table["lines"] <= MOST_LINES, table
