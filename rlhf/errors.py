"""How the engine fails: its exit codes, the one error a bad input raises, and the check that an
output dir takes files.

Every layer of `rlhf/` raises `ConfigError` for an input it cannot use, with one line that names
the binding, flag or file and what is allowed; each entry point (`python -m rlhf.train`,
`rlhf.reward_model`, `rlhf.export`, `rlhf.memory`) prints that line and exits with `EXIT_CONFIG`,
before any compute. The experiment manager exits with the same codes (experiments/errors.py), so a
study and a run say a bad input the same way.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

EXIT_OK = 0
"""Done."""
EXIT_ERROR = 1
"""Any other error (a traceback)."""
EXIT_CONFIG = 2
"""A bad configuration, flag, file or run dir: one line, before any compute."""
EXIT_DIVERGED = 3
"""Training diverged (a non-finite loss): the run dir says so in its summary.json."""
EXIT_DISK_FULL = 4
"""The disk filled: one line naming the file; nothing half-written is left, --resume continues."""
EXIT_OUT_OF_MEMORY = 5
"""A phase ran out of GPU memory: one line with the phase, its measured peak, the memory plan's figure
for it and the binding to change; the checkpoints written so far stay, --resume continues."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (or SIGTERM): one line; what was written stays."""


def honour_interrupts() -> None:
    """Ctrl-C and `kill -INT` stop this process (EXIT_INTERRUPTED) even when it started with SIGINT
    ignored, as a shell script's background job (`cmd &`, `nohup cmd &`) does: Python then installs
    no KeyboardInterrupt handler, and every child (Ray's daemons and workers, the engines) inherits
    the ignored signal, so a study's stop could not reach its runs (Ray cancels a running task by an
    interrupt in its main thread). `python -m rlhf.train` and `python -m experiments` call it first;
    the main thread only."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errnos of a full disk (or quota): the engine and the manager stop in one line, keeping what is written."""


def is_disk_full(err: BaseException | None) -> bool:
    """An OSError ENOSPC / EDQUOT, or safetensors' error for one (it reports I/O errors in its text)."""
    if isinstance(err, OSError):
        return err.errno in DISK_FULL
    text = str(err)
    return type(err).__name__ == "SafetensorError" and ("No space left on device" in text or "StorageFull" in text
                                                        or "os error 28" in text)


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the binding and what is allowed."""


def check_writable(out: Path, flag: str = "--out") -> None:
    """The output dir exists (or is made) and takes files: a ConfigError naming `flag` and the
    dir otherwise, before any compute."""
    out = Path(out)
    probe = out / f".write_probe_{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        if is_disk_full(err):
            probe.unlink(missing_ok=True)
            err.filename = err.filename or str(probe)  # the entry point's full-disk line names it (exit 4)
            raise
        raise ConfigError(f"{flag} {str(out)!r} is not a writable run dir ({err.strerror or type(err).__name__}"
                          f"{': ' + str(err.filename) if err.filename and str(err.filename) != str(probe) else ''}); "
                          f"choose a directory you can write") from None
