"""Every code block of README.md and docs/*.md runs, through Sybil.

Pages are found by glob, so a new page is tested as soon as it exists. Each
page runs top to bottom in one namespace (a block continues the ones before
it, as a reader would paste them), under JAX's default "standard" dtype
promotion (the suite itself runs with "strict"; docs show users' default),
on the 8 fake CPU devices of conftest.py, in a fresh working directory.

- ```python blocks run; one that starts with `>>>` is a doctest, and its
  printed output is checked (ELLIPSIS and NORMALIZE_WHITESPACE on).
- Blocks that are not Python use another language (```bash, ```text...).
- A block that must not run is preceded by a visible
  `<!-- skip: next "why" -->` comment, and the page says why.
"""

import doctest
import pathlib
import re
import unittest

import jax
import pytest

sybil = pytest.importorskip("sybil")
from sybil.parsers.markdown import (  # noqa: E402
  ClearNamespaceParser,
  PythonCodeBlockParser,
  SkipParser,
)

from _helpers import standard_promotion  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Fence languages that are not run. `py` is refused so that nothing escapes
# the runner by an abbreviation: use `python`, or skip the block visibly.
NOT_PYTHON = {"bash", "console", "text", "toml", "yaml"}
_FENCE = re.compile(r"^[ \t>]*(`{3,}|~{3,})[ \t]*([^\s`]*)", re.M)

_SYBIL = sybil.Sybil(
  parsers=[
    PythonCodeBlockParser(
      doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    ),
    SkipParser(),
    ClearNamespaceParser(),
  ]
)


def run_page(path):
  """Runs every example of the page in order; returns (run, skipped) counts."""
  document = _SYBIL.parse(path)
  document.namespace["__name__"] = "__main__"
  run, skipped = 0, 0
  with standard_promotion():  # what users run by default
    for example in document:
      try:
        example.evaluate()
      except unittest.SkipTest:
        skipped += 1
        continue
      run += 1
  return run, skipped


def _fence_languages(path):
  """The language of every opening fence of the page."""
  languages, open_fence = [], None
  for fence, language in _FENCE.findall(path.read_text()):
    if open_fence is None:
      open_fence = fence
      languages.append(language)
    elif fence[0] == open_fence[0] and len(fence) >= len(open_fence) and not language:
      open_fence = None
  return languages


def test_pages_are_found():
  names = {p.name for p in PAGES}
  assert {"README.md", "index.md", "checkpointing.md", "compared.md"} <= names


def _newest_only():
  """Pages written for the newest releases, and why each cannot run on older
  ones (the suite also runs on the oldest supported stack)."""
  needs = {}
  if not hasattr(jax, "shard_map"):
    needs["data-parallel.md"] = f"shows jax.shard_map (jax {jax.__version__})"
  try:
    import flax  # noqa: F401
  except ImportError:
    needs["flax.md"] = "needs Flax"
  return needs


NEWEST_ONLY = _newest_only()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_page_runs(path, tmp_path, monkeypatch):
  if path.name in NEWEST_ONLY:
    pytest.skip(NEWEST_ONLY[path.name])
  unknown = [
    lang for lang in _fence_languages(path) if lang not in NOT_PYTHON | {"python"}
  ]
  assert not unknown, f"{path.name}: code fences must say python or one of " + (
    f"{sorted(NOT_PYTHON)}, got {unknown}"
  )
  monkeypatch.chdir(tmp_path)  # pages that write files write them here
  run_page(path)


def test_checkpointing_page_runs_twice_in_a_row(tmp_path, monkeypatch):
  if "checkpointing.md" in NEWEST_ONLY:
    pytest.skip(NEWEST_ONLY["checkpointing.md"])
  monkeypatch.chdir(tmp_path)
  first = run_page(ROOT / "docs" / "checkpointing.md")
  second = run_page(ROOT / "docs" / "checkpointing.md")
  assert first == second and first[0] >= 5
