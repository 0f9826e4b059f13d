"""Files a module names and files mplower writes.

Reading: a module attribute that names a file (`mp.weights`, `mp.policy`, `mp.target`) is a
path relative to the folder of the IR file, and `module_relative` refuses one that leaves it:
an IR file is untrusted input, so it must not make mplower read (or print) anything outside
the model's folder. A file the user names on the command line may be anywhere; callers do not
pass those through here.

Writing atomically: a temporary file beside the target, then one rename. A run that fails
part-way, is interrupted (SIGINT) or terminated (SIGTERM, SIGHUP) leaves the user's previous
file exactly as it was and no temporary file, and readers never see half a file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from mplower.ir.diagnostics import DiagnosticError
from mplower.ir.graph import Module

# Signals that end a run while it may be writing: while a temporary file exists they become a
# SystemExit, so the cleanup below runs as it does for KeyboardInterrupt (SIGINT).
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))
# Test seam: with this variable set, atomic_output waits for a signal once its temporary file
# exists, so a test can terminate a run at exactly that point without guessing at timing.
PAUSE_ENV = "MPLOWER_TEST_PAUSE_IN_OUTPUT"


def module_folder(module: Module) -> Path:
    """The folder the module's file attributes are relative to: its IR file's."""
    return Path(module.path).resolve().parent


def module_relative(module: Module, attr: str, rel: str, hint: str) -> Path:
    """The file `rel` (the value of the module attribute `attr`) names, relative to the IR
    file's folder; a path that leaves that folder (`..`, an absolute path, a symbolic link out
    of it) is a diagnostic at the module that ends with `hint` (how to name the file
    deliberately). Nothing is read, so the message cannot show any of the refused file."""
    loc = module.attr_loc(attr)
    if "\0" in rel:  # no file path holds one; resolving it would raise ValueError
        raise DiagnosticError.at(loc, f"{attr} {rel!r} contains a NUL byte, which no file path "
                                      f"can")
    base = module_folder(module)
    try:
        candidate = (base / rel).resolve()
        # resolve() passes over what it cannot follow; stat() says why (ELOOP, ENAMETOOLONG).
        candidate.stat()
    except RuntimeError:  # Python before 3.13 raises this for a loop of symbolic links
        raise DiagnosticError.at(loc, f"{attr} '{_short(rel)}' cannot be opened: it is a loop "
                                      f"of symbolic links") from None
    except FileNotFoundError:
        pass  # a missing file is for the reader to report, with what it was looking for
    except OSError as e:
        raise DiagnosticError.at(loc, f"{attr} '{_short(rel)}' cannot be opened: "
                                      f"{(e.strerror or str(e)).lower()}") from None
    if not candidate.is_relative_to(base):
        raise DiagnosticError.at(loc, f"{attr} '{rel}' leaves the model's folder {base}; "
                                      f"{hint}")
    return candidate


def _short(text: str) -> str:
    """`text` cut to 60 characters for a message (a name may be thousands long)."""
    return text if len(text) <= 60 else text[:57] + "..."


def path_from(folder: Path, path: Path) -> str:
    """What a module living in `folder` records for `path`: a relative path (with `/`) when
    the file is inside the folder, else the absolute path (which module_relative refuses)."""
    path = path.resolve()
    return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _exit_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) inside the block (main thread only:
    Python delivers signals there and nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _terminate) for s in _TERMINATING}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINATING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _TERMINATING)


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    with _exit_on_termination():
        tmp = None
        try:
            # Held back until `tmp` is assigned, so that no signal can leave the file behind.
            with _signals_blocked():
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                           dir=path.parent or ".")
            with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
                if os.environ.get(PAUSE_ENV):
                    signal.pause()
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o777)
            else:
                os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_output(path) as fh:
        fh.write(text)
