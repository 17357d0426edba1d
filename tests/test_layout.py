"""The package's layout: what a reader can rely on (CONTRIBUTING.md, "Where
things are").

Every function fits one reading (80 lines of code, docstrings, comments and
blank lines aside), every module opens with what it is for, JAX's private
surface is reached from `lossscale/_jax_internals.py` only, the speed layer
(`lossscale/_speed/`) is imported by one core module, `_wrapper.py` (and
the core runs without it: tests/test_plain.py, and `make test-plain`), and
its switch (`LOSSSCALE_PLAIN`) is read in `lossscale/_speed/__init__.py`
only.
"""

import ast
import io
import pathlib
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lossscale"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES_OF_CODE = 80


def _code_lines(source: str, tree: ast.AST) -> set[int]:
  """The lines holding code: not blank, not only a comment, not a docstring."""
  docstrings: set[int] = set()
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
      value = body[0].value
      if isinstance(value, ast.Constant) and isinstance(value.value, str):
        docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
  code: set[int] = set()
  skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT)
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type in skip or tok.type == tokenize.DEDENT:
      continue
    for line in range(tok.start[0], tok.end[0] + 1):
      if line not in docstrings:
        code.add(line)
  return code


def _functions(source: str):
  """`(name, line, lines of code)` of every function in `source`, nested
  ones included (and counted in their enclosing function too)."""
  tree = ast.parse(source)
  code = _code_lines(source, tree)
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = code & set(range(node.lineno, node.end_lineno + 1))
      yield node.name, node.lineno, len(lines)


def test_the_counter_counts_code_only():
  source = "\n".join(
    [
      "def f(x):",
      '  """Doc.',
      "",
      "  More.",
      '  """',
      "  # a comment",
      "",
      "  y = (x +",
      "       1)",
      "  return y",
    ]
  )
  assert [n for _, _, n in _functions(source)] == [4]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_longer_than_one_reading(path):
  long = [
    f"{name} (line {line}): {n} lines of code"
    for name, line, n in _functions(path.read_text())
    if n > MAX_LINES_OF_CODE
  ]
  assert not long, f"{path.name}: over {MAX_LINES_OF_CODE} lines of code: {long}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_opens_with_what_it_is_for(path):
  docstring = ast.get_docstring(ast.parse(path.read_text()))
  assert docstring and len(docstring.split()) >= 5, f"{path} has no module docstring"


def test_jax_private_surface_is_reached_from_one_module():
  private = ("jax.extend", "jax._src", "jax.interpreters", "BatchTracer")
  users = {
    str(path.relative_to(PACKAGE))
    for path in MODULES
    for marker in private
    if marker in path.read_text()
  }
  assert users == {"_jax_internals.py"}


def test_the_switch_is_read_in_the_speed_layer_only():
  readers = {
    str(path.relative_to(PACKAGE))
    for path in MODULES
    if "os.environ" in path.read_text() or "getenv" in path.read_text()
  }
  assert readers == {"_speed/__init__.py"}


def _imported(path):
  """The modules `path` imports, as dotted names (`from lossscale import
  _speed` is `lossscale._speed`)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_one_core_module_reaches_the_speed_layer():
  core = [p for p in MODULES if "_speed" not in p.relative_to(PACKAGE).parts]
  importers = {
    str(path.relative_to(PACKAGE))
    for path in core
    if any(n.startswith("lossscale._speed") for n in _imported(path))
  }
  assert importers == {"_wrapper.py"}
