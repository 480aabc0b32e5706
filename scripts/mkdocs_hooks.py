"""mkdocs hooks (mkdocs.yml ``hooks:``): serve the benchmarks' pictures from where they are saved.

``docs/benchmarks.md`` links its pictures as ``../benchmarks/results/<name>.png``, the path that works when the
page is read in the repository. The site cannot reach outside ``docs/``, so these hooks add every
``benchmarks/results/*.png`` to the site as ``results/<name>.png`` and point the page's links there; nothing is
copied into ``docs/``.
"""
from __future__ import annotations

import glob
import os

from mkdocs.structure.files import File

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS_DIR = os.path.join(REPO_ROOT, "benchmarks")
REPO_LINK = "../benchmarks/results/"
SITE_LINK = "results/"


def on_files(files, config):
    for path in sorted(glob.glob(os.path.join(BENCHMARKS_DIR, "results", "*.png"))):
        files.append(File(os.path.relpath(path, BENCHMARKS_DIR), BENCHMARKS_DIR, config["site_dir"],
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "benchmarks.md":
        return markdown.replace(f"]({REPO_LINK}", f"]({SITE_LINK}")
    return markdown
