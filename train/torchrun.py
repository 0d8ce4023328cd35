"""``recpipe-torchrun`` / ``python -m recpipe.train.torchrun``: torchrun (``torch.distributed.run``,
the same options) that ends as the one-process training command does:

    recpipe-torchrun --standalone --nproc-per-node=2 -m recpipe.train trainer.steps=100

- a rank's ``error: ...`` or ``interrupted ...`` line (rank 0 prints it; another rank's comes
  from its error file, ending ``(rank R)``) is the last line, with no torchrun report or
  traceback after it;
- the exit status is the failing rank's (1, 130, 143; 128 + N for a rank killed by signal N),
  or 128 + N when torchrun itself gets signal N (SIGINT, SIGTERM: it passes the signal to the
  ranks, which save and print how to resume, with this launcher);
- torchrun's own failures (an option value it rejects, ``--nproc-per-node=abc``; its rendezvous)
  end as the training command's do (``recpipe.train.cli._caught``): one ``error:`` line naming
  the log file with the traceback, status 1 (130 for Ctrl-C before the ranks start).

Plain torchrun runs the same job; it exits 1 on every failure and prints its own report after
our line. ``LOGLEVEL``, if set, keeps torchrun's own log lines (they are off here otherwise);
``OMP_NUM_THREADS`` is 1 for several ranks per node unless set, as torchrun sets it, without its
warning.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is slow to import: imported by main()
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

#: set for the ranks: how the training command names this launcher in a resume command
LAUNCHER_ENV = "RECPIPE_LAUNCHER"


def _quiet_elastic() -> None:
    """torchrun's agent logs each failure and signal (its ``LOGLEVEL``, default WARNING): off,
    unless ``LOGLEVEL`` is set."""
    if "LOGLEVEL" in os.environ:
        return
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and name.startswith("torch.distributed.elastic"):
            logger.setLevel(logging.CRITICAL)


def _line(failure: ProcessFailure) -> str | None:
    """The line a rank ended with (the training command writes it into torchrun's error file),
    or None: the rank died without one (a signal, a crash)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return message if message.startswith(("error:", "interrupted")) else None


def _status(failure: ProcessFailure) -> int:
    """The exit status a rank chose (``status`` in its error file: torchrun may kill it while it
    exits), else the one it had, as a shell shows it (128 + N: killed by signal N)."""
    chosen = _info(failure).get("status")
    if chosen is not None:
        return int(chosen)
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1


def _silent_line(rank: int, exitcode: int) -> str:
    """The line for ``rank``, which died without one."""
    if exitcode < 0:
        return f"error: rank {rank} was killed by {signal.Signals(-exitcode).name}"
    return f"error: rank {rank} exited with status {exitcode} (its output is above)"


def _info(failure: ProcessFailure) -> dict:
    """The ``extraInfo`` the training command wrote into the rank's error file ({}: none)."""
    message = failure.message
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def _root(failures: dict[int, ProcessFailure]) -> tuple[int, str | None]:
    """The exit status and the line to print (None: rank 0 printed it) for the root failure:
    1. a rank that died without a line, killed by a signal other than SIGTERM or crashed (the
       others' lines are about losing it: gloo's "connection closed by peer");
    2. rank 0's line where every rank ended so by agreement (``together``: a signal, the
       trainer's decision);
    3. the earliest line (``time``, written before the rank leaves the process group: a rank
       that failed alone comes before the failures it caused);
    4. a rank killed by SIGTERM without a line (torchrun stops the other ranks so once one
       fails; a rank's own SIGTERM handler prints a line)."""
    lines = {r: _line(f) for r, f in failures.items()}
    if 0 in failures and lines[0] is not None and _info(failures[0]).get("together"):
        return _status(failures[0]), None

    def order(rank: int) -> tuple[int, float]:
        failure = failures[rank]
        when = float(_info(failure).get("time", failure.timestamp))
        if lines[rank] is None:
            return (2 if failure.exitcode == -signal.SIGTERM else 0), when
        return 1, when

    rank = min(failures, key=order)
    failure, line = failures[rank], lines[rank]
    if line is None:
        return _status(failure), _silent_line(rank, failure.exitcode)
    if line == lines.get(0):  # rank 0 printed it
        return _status(failure), None
    return _status(failure), f"{line} (rank {rank})"


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); end with one line and the status."""
    from recpipe.train.cli import _caught  # here: the training command imports this module

    with _caught(None):
        _launch(sys.argv[1:] if argv is None else argv)


def _launch(argv: list[str]) -> None:
    """torchrun with ``argv``; a rank's failure or a signal ends the process (:func:`main`)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    os.environ[LAUNCHER_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ and torchrun.determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's default then, without its 5-line warning
    _quiet_elastic()
    try:
        torchrun.run(args)
    except SignalException as e:  # the ranks got it too: they printed and saved
        raise SystemExit(128 + int(e.sigval)) from None
    except ChildFailedError as e:
        status, line = _root(e.failures)
        if line:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(status) from None


if __name__ == "__main__":
    main()
