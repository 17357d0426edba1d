"""The docs' benchmark tables are the ones their JSON gives.

Every table of measurements in README.md and docs/ is generated from a file
in benchmarks/results/ by benchmarks/docs_tables.py, between markers (see
that script). These tests fail when a page and its JSON disagree (run
`make docs-tables`), and check that the renderers follow the JSON.
"""

import difflib
import importlib.util
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load():
  spec = importlib.util.spec_from_file_location(
    "_docs_tables", ROOT / "benchmarks" / "docs_tables.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


docs_tables = _load()

BLOCKS = [
  block
  for page in docs_tables.pages()
  for block in docs_tables.find_blocks(page, page.read_text().split("\n"))
]


def _result(name):
  return json.loads((RESULTS / name).read_text())


def _render(kind, data, source="benchmarks/results/x.json"):
  return docs_tables.RENDERERS[kind](data, source)


def _row(lines, *cells):
  """The one table row whose first cells are `cells`."""
  start = "| " + " | ".join(cells) + " |"
  rows = [line for line in lines if line.startswith(start)]
  assert len(rows) == 1, (start, lines)
  return rows[0]


def test_the_performance_page_has_generated_tables():
  on_page = {b.kind for b in BLOCKS if b.page.name == "performance.md"}
  assert on_page == set(docs_tables.RENDERERS)


@pytest.mark.parametrize(
  "block", BLOCKS, ids=lambda b: f"{b.page.name}:{b.kind}:{b.source}"
)
def test_table_matches_its_json(block):
  lines = block.page.read_text().split("\n")
  have = lines[block.begin + 1 : block.end]
  want = docs_tables.render(block)
  diff = "\n".join(difflib.unified_diff(have, want, "page", "generated", lineterm=""))
  assert have == want, (
    f"{block.name(ROOT)} (line {block.begin + 1}) is not what its JSON gives;"
    f" run `make docs-tables`:\n{diff}"
  )


def test_every_result_feeds_a_table():
  sources = {b.source for b in BLOCKS}
  results = {p.relative_to(ROOT).as_posix() for p in RESULTS.glob("*.json")}
  assert results, "no results found"
  assert results <= sources, f"results no table shows: {sorted(results - sources)}"


def _scaled(x):
  """Every number of a JSON tree changed (ints doubled, floats x1.5)."""
  if isinstance(x, dict):
    return {k: _scaled(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_scaled(v) for v in x]
  if isinstance(x, bool) or not isinstance(x, int | float):
    return x
  return 2 * x if isinstance(x, int) else 1.5 * x


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.kind}:{b.source}")
def test_table_changes_with_its_json(block):
  data = json.loads((ROOT / block.source).read_text())
  before = _render(block.kind, data, block.source)
  assert _render(block.kind, _scaled(data), block.source) != before


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.kind}:{b.source}")
def test_extra_fields_are_ignored(block):
  data = json.loads((ROOT / block.source).read_text())

  def extra(record):
    return {**record, "a_new_field": 1.0} if isinstance(record, dict) else record

  for key, value in data.items():
    if isinstance(value, list):  # records
      data[key] = [extra(r) for r in value]
    elif isinstance(value, dict) and all(isinstance(r, dict) for r in value.values()):
      data[key] = {name: extra(r) for name, r in value.items()}  # records by name
    elif isinstance(value, dict):  # the environment
      data[key] = extra(value)
  data["a_new_section"] = {"x": 1}
  on_page = [line.removeprefix(block.indent) for line in docs_tables.render(block)]
  assert _render(block.kind, data, block.source) == on_page[1:-1]


def test_optimizer_step_row_and_targets_follow_the_numbers():
  data = _result("optimizer_step_cpu.json")
  for r in data["results"]:
    if (r["variant"], r["case"]) == ("lossscale.apply_gradients", "finite"):
      r.update(median_ms=50.04, time_vs_plain=1.2449, bytes_accessed_mb=1234.4)
  lines = _render("optimizer_step", data)
  row = _row(lines, "**lossscale.apply_gradients**", "finite")
  assert row.startswith(
    "| **lossscale.apply_gradients** | finite | 50.0 | **1.24x** | 1234 |"
  )
  target = "`apply_gradients`: finite step <= 1.25x bare"
  assert _row(_render("optimizer_step_targets", data), target).endswith(
    "| 1.24x | met |"
  )
  for r in data["results"]:
    if (r["variant"], r["case"]) == ("lossscale.apply_gradients", "finite"):
      r["time_vs_plain"] = 1.2551
  assert _row(_render("optimizer_step_targets", data), target).endswith(
    "| 1.26x | **not met** |"
  )


def test_peer_target_compares_with_the_fastest_peer():
  data = _result("optimizer_step_cpu.json")
  times = {"lossscale: tx.update + apply_updates": 60.0, "optax.apply_if_finite": 61.0}
  times |= {
    "jmp DynamicLossScale + select_tree": 59.0,
    "flax DynamicScale + where": 70.0,
  }
  for r in data["results"]:
    if r["case"] == "finite" and r["variant"] in times:
      r["median_ms"] = times[r["variant"]]
  lines = _render("optimizer_step_targets", data)
  row = _row(lines, "`tx.update` + `apply_updates` ahead of every peer (finite)")
  assert "fastest peer 59.0 ms (jmp DynamicLossScale + select_tree)" in row
  assert row.endswith("| **not met** |")
  times["jmp DynamicLossScale + select_tree"] = 60.5
  for r in data["results"]:
    if r["case"] == "finite" and r["variant"] in times:
      r["median_ms"] = times[r["variant"]]
  row = _row(
    _render("optimizer_step_targets", data),
    "`tx.update` + `apply_updates` ahead of every peer (finite)",
  )
  assert "fastest peer 60.5 ms" in row and row.endswith("| met |")


def test_compile_time_targets_follow_the_numbers():
  data = _result("compile_time_cpu.json")
  data.pop("targets", None)  # no rounds: the sweep's one measurement
  for r in data["results"]:
    if r["leaves"] == 2000 and r["variant"] == "lossscale.apply_gradients":
      r["vs_bare"] = 1.49
    if r["leaves"] == 2000 and r["variant"] == "lossscale: tx.update + apply_updates":
      r["vs_bare"] = 2.51
  data["eager"]["lossscale.apply_gradients"]["compilations_after_first"] = 1
  lines = _render("compile_time_targets", data)
  fused = "`apply_gradients`: trace + compile at 2000 leaves <= 1.5x bare"
  update = "`tx.update` + `apply_updates`: trace + compile at 2000 leaves <= 2.5x bare"
  assert _row(lines, fused).endswith("| 1.49x | met |")
  assert _row(lines, update).endswith("| 2.51x | **not met** |")
  assert lines[-1].endswith("| 0, 1 | **not met** |")


def test_compile_time_targets_take_the_rotated_rounds_when_there_are_some():
  data = _result("compile_time_cpu.json")
  fused, update = "lossscale.apply_gradients", "lossscale: tx.update + apply_updates"
  for r in data["results"]:
    if r["leaves"] == 2000 and r["variant"] == fused:
      r["vs_bare"] = 1.2  # the sweep's: not the one shown
  data["targets"] = dict(
    leaves=2000,
    rounds=3,
    steps={
      fused: dict(total_s=[1, 2, 3], vs_bare=1.52, vs_bare_min=1.4, vs_bare_max=1.6),
      update: dict(total_s=[1, 2, 3], vs_bare=2.0, vs_bare_min=1.9, vs_bare_max=2.1),
    },
  )
  lines = _render("compile_time_targets", data)
  at = "trace + compile at 2000 leaves"
  fused_row = f"`apply_gradients`: {at} <= 1.5x bare"
  update_row = f"`tx.update` + `apply_updates`: {at} <= 2.5x bare"
  assert _row(lines, fused_row).endswith("| 1.52x (1.40-1.60) | **not met** |")
  assert _row(lines, update_row).endswith("| 2.00x (1.90-2.10) | met |")
  header = "| target | measured (median of 3 rounds in rotated order; range) |"
  assert any(line.startswith(header) for line in lines)


def test_compile_phases_ratio_is_computed_from_totals():
  data = _result("compile_phases_cpu.json")
  records = [r for r in data["records"] if r["leaves"] == 500]
  for r, total in zip(records, (2.0, 5.0, 3.0), strict=True):
    r.update(trace_s=total / 2, lower_s=0.0, compile_s=total / 2)
  lines = _render("compile_phases", data)
  assert _row(lines, "500", "bare adamw").startswith(
    "| 500 | bare adamw | 2.00 | 1.00x |"
  )
  row = _row(lines, "500", "`tx.update` + `apply_updates`")
  assert row.startswith("| 500 | `tx.update` + `apply_updates` | 5.00 | 2.50x |")


def test_source_line_comes_from_the_environment():
  data = _result("train_step_cpu.json")
  data["environment"].update(
    jax="9.8.7", commit="abc1234", backend="gpu", device="NVIDIA H200", cpu_count=16
  )
  for peer in ("jmp", "flax"):
    data["environment"].pop(peer, None)
  line = _render("train_step", data, "benchmarks/results/train_step_gpu.json")[0]
  assert line.startswith(
    "`benchmarks/results/train_step_gpu.json` (lossscale at abc1234, jax 9.8.7,"
    " optax 0.2.8; GPU (NVIDIA H200), 16 CPU cores): an MLP of 4 x 512"
  )
  del data["environment"]
  line = _render("train_step", data)[0]
  assert "(environment not recorded)" in line


def test_a_missing_field_is_named():
  data = _result("train_step_cpu.json")
  del data["results"][1]["temp_mb"]
  with pytest.raises(docs_tables.TableError, match=r"'temp_mb'.*dynamic_loss_scale"):
    _render("train_step", data)


_PAGE = """\
# A page

Before.

{indent}<!-- generated: train_step from benchmarks/results/train.json by \
benchmarks/docs_tables.py; do not edit -->
{indent}<!-- end generated -->

After.
"""


def _tree(tmp_path, indent=""):
  (tmp_path / "docs").mkdir()
  (tmp_path / "benchmarks" / "results").mkdir(parents=True)
  page = tmp_path / "docs" / "page.md"
  page.write_text(_PAGE.format(indent=indent))
  source = tmp_path / "benchmarks" / "results" / "train.json"
  # Numbers of our own, so that the expected rows do not follow a re-run.
  data = _result("train_step_cpu.json")
  for r, (ms, ratio, temp) in zip(
    data["results"], ((9.9, 1.0, 6.1), (9.3, 0.94, 9.1), (9.9, 1.0, 9.1)), strict=True
  ):
    r.update(median_ms=ms, time_vs_no_scaling=ratio, temp_mb=temp)
  source.write_text(json.dumps(data))
  return page, source


def test_write_then_check_on_a_tree(tmp_path, capsys):
  page, source = _tree(tmp_path)
  assert docs_tables.main(["--check", "--root", str(tmp_path)]) == 1
  assert docs_tables.main(["--write", "--root", str(tmp_path)]) == 0
  text = page.read_text()
  assert text.startswith("# A page\n\nBefore.\n\n<!-- generated: train_step")
  assert text.endswith("<!-- end generated -->\n\nAfter.\n")
  assert "| float16, no loss scaling (adamw) | 9.9 | 1.00x | 6.1 |" in text
  assert docs_tables.check(tmp_path) == []
  assert docs_tables.main(["--check", "--root", str(tmp_path)]) == 0

  data = json.loads(source.read_text())
  data["results"][2]["time_vs_no_scaling"] = 1.5
  source.write_text(json.dumps(data))
  problems = docs_tables.check(tmp_path)
  assert len(problems) == 1
  line_no = text.split("\n").index(
    "| float16, dynamic_loss_scale: apply_gradients | 9.9 | 1.00x | 9.1 |"
  )
  assert problems[0].startswith(
    f"docs/page.md:{line_no + 1}: table train_step differs from"
    " benchmarks/results/train.json"
  )
  assert (
    "page:      | float16, dynamic_loss_scale: apply_gradients | 9.9 | 1.00x"
    in (problems[0])
  )
  assert (
    "generated: | float16, dynamic_loss_scale: apply_gradients | 9.9 | 1.50x"
    in (problems[0])
  )
  capsys.readouterr()
  assert docs_tables.main(["--check", "--root", str(tmp_path)]) == 1
  assert "table train_step differs" in capsys.readouterr().err
  assert docs_tables.main(["--write", "--root", str(tmp_path)]) == 0
  assert docs_tables.check(tmp_path) == []
  assert page.read_text() == text.replace(
    "apply_gradients | 9.9 | 1.00x", "apply_gradients | 9.9 | 1.50x"
  )


def test_an_indented_block_stays_indented(tmp_path):
  page, _ = _tree(tmp_path, indent="   ")
  docs_tables.write(tmp_path)
  lines = page.read_text().split("\n")
  start = lines.index("   <!-- end generated -->")
  assert (
    lines[start - 2]
    == "   | float16, dynamic_loss_scale: apply_gradients | 9.9 | 1.00x | 9.1 |"
  )
  assert docs_tables.check(tmp_path) == []


@pytest.mark.parametrize(
  ("page", "message"),
  [
    (
      _PAGE.replace("train_step from", "no_such_kind from"),
      "page.md:5: unknown table kind",
    ),
    (
      _PAGE.replace("{indent}<!-- end generated -->\n", ""),
      "page.md:5: the block is never ended",
    ),
    (_PAGE.replace("; do not edit", ""), "page.md:5: a marker in neither form"),
    (
      _PAGE.replace("train.json", "missing.json"),
      "no such file benchmarks/results/missing.json",
    ),
    ("<!-- end generated -->\n", "page.md:1: '<!-- end generated -->' without a block"),
  ],
)
def test_bad_markers_are_errors(tmp_path, capsys, page, message):
  path, _ = _tree(tmp_path)
  path.write_text(page.format(indent=""))
  with pytest.raises(docs_tables.TableError, match=re.escape(message)):
    docs_tables.check(tmp_path)
  assert docs_tables.main(["--check", "--root", str(tmp_path)]) == 1
  assert message.split(": ", 1)[-1] in capsys.readouterr().err
  # --write refuses too, and leaves the page as it was.
  assert docs_tables.main(["--write", "--root", str(tmp_path)]) == 1
  assert path.read_text() == page.format(indent="")


def test_blocks_cannot_nest(tmp_path):
  path, _ = _tree(tmp_path)
  marker = _PAGE.split("\n")[4].format(indent="")
  path.write_text(f"{marker}\n{marker}\n<!-- end generated -->\n")
  with pytest.raises(
    docs_tables.TableError, match=re.escape("page.md:2: a block opens before")
  ):
    docs_tables.check(tmp_path)


def test_make_docs_tables_runs_as_contributing_says(tmp_path):
  # CONTRIBUTING says to run `make docs-tables` after a benchmark; with
  # PYTHON unset it once ran the script itself, which is not executable.
  import shutil
  import subprocess

  if not (ROOT / "Makefile").exists() or shutil.which("make") is None:
    pytest.skip("needs the repository's Makefile and make (not in the sdist)")
  for name in ("Makefile", "README.md"):
    shutil.copy(ROOT / name, tmp_path / name)
  for name in ("benchmarks", "docs"):
    shutil.copytree(ROOT / name, tmp_path / name)
  env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHON"}
  proc = subprocess.run(
    ["make", "-s", "docs-tables"], cwd=tmp_path, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr
  # Nothing to rewrite: the tables in the repository are current.
  for page in ("README.md", "docs/performance.md"):
    assert (tmp_path / page).read_text() == (ROOT / page).read_text(), page
