"""The suite's backstop: a hang ends with every thread's stack, not silence."""

import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

_HANG = """
import threading, time
import _backstop
_backstop.arm(1.0)
def waiting_for_a_replica():
  time.sleep(60)
threading.Thread(target=waiting_for_a_replica, daemon=True).start()
time.sleep(60)
"""


def test_a_hung_process_prints_every_thread_and_exits():
  start = time.monotonic()
  proc = subprocess.run(
    [sys.executable, "-c", _HANG],
    cwd=HERE,
    capture_output=True,
    text=True,
    timeout=50,
  )
  assert time.monotonic() - start < 30
  assert proc.returncode != 0
  assert "waiting_for_a_replica" in proc.stderr  # the other thread's stack
  assert proc.stderr.count("Thread 0x") >= 2


def test_the_suite_ends_a_hung_test_with_its_stack(tmp_path):
  # The suite's own conftest, on a test that never returns.
  import os
  import shutil

  for name in ("conftest.py", "_backstop.py", "_speed_blocker.py"):
    shutil.copy(HERE / name, tmp_path / name)
  (tmp_path / "test_hang.py").write_text(
    "import time\n\ndef test_hangs_forever():\n  time.sleep(120)\n"
  )
  env = dict(os.environ, LOSSSCALE_SUITE_LIMIT_S="3")
  start = time.monotonic()
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hang.py"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=100,
  )
  assert time.monotonic() - start < 90
  assert proc.returncode != 0
  assert "test_hangs_forever" in proc.stdout + proc.stderr
