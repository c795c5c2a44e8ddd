"""``make docs-check``: every page of the built site in headless Chromium at 1280 px.

For each page of ``site/`` (a copy, with a measuring script added) it takes a screenshot
into ``out/docs-screenshots/`` and reads what the script found once the page had
loaded: the page's width against the window's, and every code block, table and code
span of the content whose content is wider than its box (cut off, or hidden behind a
scrollbar) or that reaches past the window.  It prints one line per page and exits 1
if any page is wider than the window or hides anything.

    python tests/docs_layout.py [SITE_DIR] [SCREENSHOT_DIR]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

WIDTH, HEIGHT = 1280, 800
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
MEASURE = """
<script>
window.addEventListener('load', () => {
  const W = window.innerWidth, hidden = [];
  const boxes = '.md-content pre, .md-content table, .md-content .md-typeset__scrollwrap, '
      + '.md-content code';
  for (const el of document.querySelectorAll(boxes)) {
    const right = el.getBoundingClientRect().right;
    if (el.scrollWidth > el.clientWidth + 1 || right > W + 1)
      hidden.push([el.tagName, el.scrollWidth, el.clientWidth, Math.round(right),
                   el.textContent.trim().slice(0, 60)]);
  }
  const report = document.createElement('pre');
  report.id = 'layout-report';
  report.textContent = JSON.stringify({page: document.documentElement.scrollWidth,
                                       window: W, hidden});
  document.body.appendChild(report);
});
</script>
"""
REPORT = re.compile(r'id="layout-report">([^<]*)<')


def chromium() -> str:
    for name in CHROMIUM:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("docs-check: no headless Chromium found (apt-get install chromium)")


def pages(site: str) -> list[str]:
    found = []
    for folder, _, files in os.walk(site):
        for name in files:
            if name == "index.html" and "assets" not in folder:
                found.append(os.path.relpath(os.path.join(folder, name), site))
    return sorted(found)


def browse(browser: str, url: str, *flags: str) -> str:
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=3000", *flags, url],
        capture_output=True, text=True, timeout=60)
    return out.stdout


def check(site: str, screenshots: str) -> int:
    browser = chromium()
    os.makedirs(screenshots, exist_ok=True)
    work = tempfile.mkdtemp(prefix="docs-check-")
    copy = os.path.join(work, "site")
    shutil.copytree(site, copy)
    problems = 0
    try:
        for page in pages(copy):
            path = os.path.join(copy, page)
            with open(path, encoding="utf-8") as f:
                html = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(html.replace("</body>", MEASURE + "</body>"))
            url = f"file://{path}"
            match = REPORT.search(browse(browser, url, "--dump-dom"))
            shot = os.path.join(screenshots, page.replace("/", "_").removesuffix(
                "_index.html").removesuffix("index.html").strip("_") or "home") + ".png"
            browse(browser, url, f"--screenshot={shot}")
            if match is None:
                print(f"✗ {page}: the page did not load")
                problems += 1
                continue
            report = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&")
                                .replace("&lt;", "<").replace("&gt;", ">"))
            wide = report["page"] > report["window"]
            bad = wide or report["hidden"]
            problems += bool(bad)
            print(f"{'✗' if bad else '✓'} {page}: {report['page']} px in a {report['window']} "
                  f"px window, {len(report['hidden'])} box(es) hiding content")
            for tag, scroll, client, right, text in report["hidden"][:10]:
                print(f"    {tag} {scroll} px of content in {client} px, right edge {right}: "
                      f"{text!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{problems} page(s) with a problem; screenshots in {screenshots}" if problems
          else f"every page fits {WIDTH} px; screenshots in {screenshots}")
    return 1 if problems else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(check(args[0] if args else "site",
                   args[1] if len(args) > 1 else os.path.join("out", "docs-screenshots")))
