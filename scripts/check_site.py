"""Render the built docs site in headless Chromium and check what a reader sees.

    python scripts/check_site.py [--out DIR] [--width 1280] [--page phases/05-paged-kv/ ...]

Builds the site (``mkdocs build --strict`` into a temporary directory), serves it on
127.0.0.1, and for the home page, a phase page and the benchmarks page (or the pages given):

* takes a screenshot at ``--width`` pixels (``DIR/<page>.png``: look at them);
* checks, in the browser, that every image loaded (``naturalWidth > 0``) and that no table,
  code block or diagram is cut off on the right (its content is wider than the box it is shown
  in, so part of it is hidden behind a scroll bar or the page edge).

Exit status 0 when every page passes, 1 otherwise (each problem printed). Needs Chromium, which
is not a Python package: on Debian/Ubuntu ``apt-get install -y chromium``; ``--chromium`` names
another binary. Not part of CI, which has no browser.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["", "phases/05-paged-kv/", "benchmarks/"]

# Runs in the page once it has loaded; its verdict is written into the DOM, which Chromium's
# --dump-dom prints (no DevTools protocol needed).
CHECK_JS = """
<script>
window.addEventListener("load", () => setTimeout(() => {
  const problems = [];
  for (const img of document.images) {
    if (!img.complete || img.naturalWidth === 0) problems.push("image did not load: " + img.getAttribute("src"));
  }
  // a table sits in a scrolling wrapper (with 0.8rem of padding on each side): cut off when the
  // wrapper has more to scroll than that; a text block (diagram, log) when its code box scrolls
  const content = document.querySelector(".md-content") || document.body;
  const slack = 2 * parseFloat(getComputedStyle(document.documentElement).fontSize) * 0.8 + 2;
  const describe = (el) => (el.innerText || "").trim().split("\\n")[0].slice(0, 70);
  for (const wrap of content.querySelectorAll(".md-typeset__scrollwrap")) {
    const hidden = wrap.scrollWidth - wrap.clientWidth;
    if (hidden > slack) problems.push(`table cut off by ${hidden} px: "${describe(wrap)}"`);
  }
  for (const code of content.querySelectorAll("pre > code")) {  // diagrams and logs, not commands
    if (code.querySelector("span[class]")) continue;  // highlighted: a command or code, which may scroll
    const hidden = code.scrollWidth - code.clientWidth;
    if (hidden > 2) problems.push(`text block cut off by ${hidden} px: "${describe(code)}"`);
  }
  const out = document.createElement("pre");
  out.id = "site-check";
  out.textContent = JSON.stringify(problems);
  document.body.appendChild(out);
}, 500));
</script>
"""


def find_chromium(name: str | None) -> str:
    for candidate in [name] if name else ["chromium", "chromium-browser", "google-chrome"]:
        path = shutil.which(candidate)
        if path:
            return path
    raise SystemExit("no Chromium found: apt-get install -y chromium (or pass --chromium PATH)")


def build(site: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(site)],
                   cwd=ROOT, env=env, check=True)


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def chromium(binary: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage",
           "--virtual-time-budget=8000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def check_page(binary: str, site: Path, base: str, page: str, out: Path, width: int) -> list[str]:
    index = site / page / "index.html"
    if not index.exists():
        return [f"{page or 'home'}: not built ({index})"]
    # a copy of the page carrying the check, next to the original (same relative links)
    probe = index.with_name("site-check.html")
    probe.write_text(index.read_text().replace("</body>", CHECK_JS + "</body>"))
    name = (page.strip("/").replace("/", "_") or "home") + ".png"
    shot = chromium(binary, f"--window-size={width},2400", f"--screenshot={out / name}", base + page)
    dom = chromium(binary, f"--window-size={width},2400", "--dump-dom", base + page + "site-check.html")
    m = re.search(r'<pre id="site-check">(.*?)</pre>', dom.stdout, re.S)
    if m is None:
        return [f"{page or 'home'}: the check did not run ({dom.stderr.strip()[-300:]})"]
    problems = [f"{page or 'home'}: {p}" for p in json.loads(html.unescape(m[1]))]
    if shot.returncode != 0 or not (out / name).exists():
        problems.append(f"{page or 'home'}: no screenshot ({shot.stderr.strip()[-300:]})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "site-check", help="where the screenshots go")
    ap.add_argument("--width", type=int, default=1280, help="window width in CSS pixels")
    ap.add_argument("--page", action="append", default=None, help="site path of a page (repeatable)")
    ap.add_argument("--chromium", default=None, help="the browser binary (default: chromium on PATH)")
    args = ap.parse_args(argv)
    binary = find_chromium(args.chromium)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        server, base = serve(site)
        try:
            problems = [p for page in (args.page or PAGES) for p in check_page(binary, site, base, page, args.out,
                                                                             args.width)]
        finally:
            server.shutdown()
    for p in problems:
        print(p)
    print(f"screenshots in {args.out}; {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
