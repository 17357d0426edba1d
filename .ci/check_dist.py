"""Checks what the built sdist and wheel hold: `python .ci/check_dist.py DIR`.

The wheel is the package and its metadata: `lossscale/` (with `py.typed`,
so type checkers read its annotations) and the license, nothing else (no
tests, docs, examples or benchmarks). The sdist is what builds that wheel and
runs its test suite (the package, tests, and the docs and examples the tests
run), with the benchmarks the docs cite; repository tooling (.github, .ci,
the Makefile, .readthedocs.yaml) stays out.
"""

import pathlib
import sys
import tarfile
import tomllib
import zipfile

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SDIST_TOP = {
  ".gitignore",  # hatchling adds it to every sdist
  "CHANGELOG.md",
  "LICENSE",
  "PKG-INFO",
  "README.md",
  "benchmarks",
  "docs",
  "examples",
  "lossscale",
  "mkdocs.yml",
  "pyproject.toml",
  "tests",
}


def _fail(message):
  raise SystemExit(f"check_dist: {message}")


def check(dist):
  project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
  stem = f"{project['name']}-{project['version']}"
  wheels = sorted(dist.glob(f"{stem}-*.whl"))
  sdists = sorted(dist.glob(f"{stem}.tar.gz"))
  if len(wheels) != 1 or len(sdists) != 1:
    _fail(f"expected one {stem} wheel and one sdist in {dist}, got {wheels + sdists}")

  with zipfile.ZipFile(wheels[0]) as wheel:
    names = wheel.namelist()
  info = f"{stem}.dist-info/"
  stray = [n for n in names if not n.startswith(("lossscale/", info))]
  if stray:
    _fail(f"the wheel holds files outside the package: {stray}")
  sources = {p.relative_to(_ROOT).as_posix() for p in _ROOT.glob("lossscale/**/*.py")}
  for required in [*sorted(sources), "lossscale/py.typed", f"{info}licenses/LICENSE"]:
    if required not in names:
      _fail(f"the wheel lacks {required}")

  with tarfile.open(sdists[0]) as sdist:
    members = [m.name.split("/", 1) for m in sdist.getmembers()]
  if any(m[0] != stem for m in members):
    _fail(f"the sdist has entries outside {stem}/")
  paths = {m[1] for m in members if len(m) == 2}
  top = {p.split("/", 1)[0] for p in paths}
  if top != _SDIST_TOP:
    _fail(
      f"the sdist's top level is {sorted(top)};"
      f" extra {sorted(top - _SDIST_TOP)}, missing {sorted(_SDIST_TOP - top)}"
    )
  if any("__pycache__" in p or p.endswith(".pyc") for p in paths):
    _fail("the sdist holds compiled Python files")
  print(f"check_dist: {wheels[0].name}: {len(names)} files; {sdists[0].name}: ok")


if __name__ == "__main__":
  check(pathlib.Path(sys.argv[1]))
