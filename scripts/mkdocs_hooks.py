"""mkdocs hook: links from the docs to the repository's source files, checked and rendered on the site.

A page links to a file of the repository by its relative path, as it would on GitHub or in an editor::

    the pool itself is [`block_pool.py`](../../src/infer/engine/block_pool.py)

Such a link points outside ``docs/``, which mkdocs cannot serve. This hook (``hooks:`` in
``mkdocs.yml``) finds every link to a file under ``src/``, ``classroom/``, ``benchmarks/``,
``scripts/`` or ``tests/``, generates a page that shows the file with line numbers
(``source/<path>/``, kept out of the navigation and the search index), and points the link there; a
fragment ``#L120`` becomes that line's anchor. A link to a file that does not exist is a warning,
which ``mkdocs build --strict`` turns into a failure: the pages cannot link to code that moved.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.source_links")

ROOT = Path(__file__).resolve().parent.parent
TOP = ("src", "classroom", "benchmarks", "scripts", "tests")
LANGUAGES = {".py": "python", ".sh": "bash", ".toml": "toml", ".json": "json", ".md": "markdown", ".yml": "yaml"}
# [text](target) where the target leaves docs/ (starts with ../); text may hold `code` but no ]
LINK = re.compile(r"\]\((?P<target>(?:\.\./)+[^)\s#]+)(?P<fragment>#[^)\s]*)?\)")


def _repo_path(page_uri: str, target: str) -> str | None:
    """The repository path (``src/infer/x.py``) a link from the docs page ``page_uri`` (relative to
    ``docs/``) points to, or None when it does not leave ``docs/`` for one of :data:`TOP`."""
    path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    return path if path.split("/", 1)[0] in TOP else None


def _source_uri(repo_path: str) -> str:
    return f"source/{repo_path}.md"


def on_files(files: Files, config) -> Files:
    """A generated page for every repository file some page links to."""
    wanted: set[str] = set()
    for f in files.documentation_pages():
        for m in LINK.finditer(Path(f.abs_src_path).read_text(encoding="utf-8")):
            path = _repo_path(f.src_uri, m["target"])
            if path is not None and (ROOT / path).is_file():
                wanted.add(path)
    for path in sorted(wanted):
        text = (ROOT / path).read_text(encoding="utf-8")
        lang = LANGUAGES.get(Path(path).suffix, "text")
        fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
        content = (f"---\nsearch:\n  exclude: true\n---\n\n# `{path}`\n\n"
                   f'{fence}{lang} linenums="1"\n{text}\n{fence}\n')
        files.append(File.generated(config, _source_uri(path), content=content, inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point links to repository files at their generated pages; warn about links to missing files."""
    def rewrite(m: re.Match) -> str:
        path = _repo_path(page.file.src_uri, m["target"])
        if path is None:
            return m[0]
        if not (ROOT / path).is_file():
            log.warning("%s links to %s, which is not a file of the repository", page.file.src_uri, path)
            return m[0]
        link = posixpath.relpath(_source_uri(path), posixpath.dirname(page.file.src_uri) or ".")
        fragment = m["fragment"] or ""
        line = re.fullmatch(r"#L(\d+)(?:-L\d+)?", fragment)
        if line:
            fragment = f"#__codelineno-0-{line[1]}"
        return f"]({link}{fragment})"

    return LINK.sub(rewrite, markdown)
