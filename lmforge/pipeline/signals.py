"""How ``pipeline run`` takes signals: a SIGTERM outside a training loop raises ``Terminated`` (as Ctrl-C raises
KeyboardInterrupt), and a few steps that must not be cut in two (moving an output aside and recording it,
starting torchrun) hold SIGINT and SIGTERM back until they are done. Here, below both ``lmforge.pipeline``
and ``lmforge.pipeline.stages``, so that each can raise and catch ``Terminated``."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """A SIGTERM to ``run_pipeline`` outside a training loop (which turns one into a stop at a checkpoint
    of its own), raised like Ctrl-C's KeyboardInterrupt: the stage is recorded as interrupted, and what it
    was writing is dropped whole (every output is renamed into place once complete). Also what a stage
    on several processes raises when a SIGTERM stopped torchrun before its processes could checkpoint
    (while they prepared their data, say)."""

    signum = signal.SIGTERM


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While a run is in progress, SIGTERM raises ``Terminated`` (by default it would kill the process at
    once, leaving the stage's record "running"). The training loop and the torchrun launcher set handlers
    of their own while they train and put this one back. Restores the previous handler afterwards. A
    SIGTERM the process was started ignoring (SIG_IGN, inherited from whatever launched it) stays
    ignored."""
    if not _main_thread():
        yield  # handlers can only be set from the main thread: SIGTERM is left to the program
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield  # whoever started this process asked for SIGTERM to be ignored: it is
        return
    raised: list[int] = []

    def handler(signum, _frame) -> None:
        # Once: a second SIGTERM while the first unwinds would cut short the record being written.
        if not raised:
            raised.append(signum)
            raise Terminated(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:  # (None: a handler set outside Python; the default is the closest)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that come while the block runs are handled when it ends, by the handlers there
    were before it (a KeyboardInterrupt or ``Terminated`` then comes out of the ``with``), so that what
    the block does is done whole: an output moved aside and the record of the move saved, torchrun
    started and known to the code that stops it. (Handlers, not ``signal.pthread_sigmask``: a process's
    signal goes to any thread that does not block it, and Python runs its handler in the main thread all
    the same.) Outside the main thread, where no handler can be set, it does nothing."""
    if not _main_thread():
        yield
        return
    got: list[int] = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:  # None: set outside Python, left alone
            previous[signum] = signal.signal(signum, lambda s, _frame: got.append(s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(got):  # each once, in the order they came
            signal.raise_signal(signum)
