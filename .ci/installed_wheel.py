"""Runs a script on the installed lossscale: `python -I installed_wheel.py SCRIPT`.

`make dist-check` runs it with the Python of a fresh venv that holds only the
built wheel and its dependencies, from a directory outside the source tree;
`-I` keeps the current and the script's directories off `sys.path`. It checks
that `lossscale` is the installed wheel (with `py.typed`, its version from the
metadata), then runs SCRIPT (the quickstart) and shows what it printed.
"""

import contextlib
import io
import pathlib
import runpy
import sys
import sysconfig
from importlib import metadata

import lossscale

site = pathlib.Path(sysconfig.get_path("purelib")).resolve()
package = pathlib.Path(lossscale.__file__).resolve().parent
if package.parent != site:
  raise SystemExit(f"lossscale was imported from {package}, not from {site}")
if not (package / "py.typed").is_file():
  raise SystemExit(f"the installed package {package} has no py.typed")
version = metadata.version("lossscale")
if lossscale.__version__ != version:
  raise SystemExit(f"lossscale.__version__ {lossscale.__version__} != {version}")
print(f"lossscale {version}, imported from {package}")

output = io.StringIO()
with contextlib.redirect_stdout(output):
  runpy.run_path(sys.argv[1], run_name="__main__")
print(output.getvalue(), end="")
if "skipped steps 1," not in output.getvalue():  # the README's claim
  raise SystemExit(f"{sys.argv[1]} did not print 'skipped steps 1,'")
