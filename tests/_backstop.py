"""A backstop for a hung test run: every thread's stack, then exit.

`arm(seconds)` makes the process print the stack of every thread to stderr
and exit after `seconds`, unless `disarm()` runs first (the standard
library's `faulthandler`, which works even when the hang holds the GIL in
C code, such as a collective waiting for a replica that never comes).
"""

import faulthandler
import sys


def arm(seconds: float, fd: int | None = None) -> None:
  """`fd`: where to write (a copy of the real stderr, under pytest's capture)."""
  target = sys.__stderr__ if fd is None else fd
  faulthandler.dump_traceback_later(seconds, exit=True, file=target)


def disarm() -> None:
  faulthandler.cancel_dump_traceback_later()
