"""Files a module names and files mplower writes.

Reading: a module attribute that names a file (`mp.weights`, `mp.policy`, `mp.target`) is a
path relative to the folder of the IR file, and `module_relative` refuses one that leaves it:
an IR file is untrusted input, so it must not make mplower read (or print) anything outside
the model's folder. A file the user names on the command line may be anywhere; callers do not
pass those through here.

Writing: every output goes first to a stage file beside its destination,
`.NAME.mplower-PID-XXXX.tmp`, and becomes the destination by one rename. A command stages all
of its outputs in one `OutputSet` (`output_set`) and commits them together only when it
succeeded, so a failed, interrupted (SIGINT) or terminated (SIGTERM, SIGHUP) run leaves every
previous file exactly as it was and no stage file, and readers never see half a file. A
SIGKILL cannot be caught: it may leave stage files, never a half-replaced user file, and the
next run that writes the same destination removes them (their process is gone). The renames of
one commit are not one atomic step: a SIGKILL in the microseconds between two of them would
leave some new and some old files.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mplower.ir.diagnostics import DiagnosticError

if TYPE_CHECKING:  # only annotations: the CLI imports this module before it parses anything
    from mplower.ir.graph import Module

# Signals that end a run while it may be writing: while a stage file exists they become a
# SystemExit, so the cleanup below runs as it does for KeyboardInterrupt (SIGINT).
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))
# What marks a stage file (or a stage folder of `tune -o DIR`) as mplower's own.
STAGE_MARK = ".mplower-"
# Test seams: with one of these set, the run says so on stderr and waits for a signal once its
# first stage file exists (PAUSE_ENV) or once every output is staged, just before the commit
# (COMMIT_PAUSE_ENV), so a test can terminate or kill it at exactly that point without guessing
# at timing (tests/test_data_loss.py).
PAUSE_ENV = "MPLOWER_TEST_PAUSE_IN_OUTPUT"
COMMIT_PAUSE_ENV = "MPLOWER_TEST_PAUSE_BEFORE_COMMIT"


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


def _pause_for_test(variable: str) -> None:
    if os.environ.get(variable):
        sys.stderr.write(f"{variable}: paused\n")  # what the test waits for
        sys.stderr.flush()
        while True:  # not signal.pause(): a signal just before it would leave it waiting forever
            time.sleep(0.05)


def stage_name(name: str) -> str:
    """The prefix of this process's stage files for the file or folder `name`."""
    return f".{name}{STAGE_MARK}{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True
    return True


def sweep_stale(path: Path) -> None:
    """Remove the stage files (or folders) of `path` that a killed run left behind: those whose
    process is gone. A live run's, and every file the user named, are left alone."""
    pattern = re.compile(rf"\.{re.escape(path.name)}{re.escape(STAGE_MARK)}(\d+)-[^/]*\Z")
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _same(a: Path, b: Path) -> bool:
    return os.path.normcase(a.resolve()) == os.path.normcase(b.resolve())


class OutputCollision(Exception):
    """Two outputs of one command, or an output and one of its inputs, are the same file."""


class CommitError(OSError):
    """A staged output could not be put in place; `filename` is the output's path."""


class OutputSet:
    """The files one command writes, committed together.

    Each output is staged as `.NAME.mplower-PID-XXXX.tmp` in its destination folder (same file
    system, so the commit is a rename) and is renamed into place only by `commit`, after the
    whole command succeeded; what goes to stdout (`-`) is held until then too. The commit runs
    with SIGTERM and SIGHUP held back, so a terminated run leaves the old set or the new set;
    `discard` (a failed or interrupted run) removes every stage file. A SIGKILL leaves its
    stage files, never a replaced user file; the next run to the same file removes them.
    Within the set a path staged again replaces the earlier stage (a pass that rewrites the
    weights twice); a path that is `protect`ed (an input) refuses to be staged at all.
    """

    def __init__(self) -> None:
        self._staged: dict[Path, Path] = {}  # final path (absolute) -> its stage file
        self._stdout: list[bytes] = []
        self._protected: list[tuple[Path, str]] = []

    def protect(self, path: str | Path | None, what: str) -> None:
        """Refuse any output that is `path` (resolved, so an alias is caught too)."""
        if path is not None and str(path) != "-":
            self._protected.append((Path(path), what))

    def check(self, path: Path) -> None:
        for kept, what in self._protected:
            if _same(path, kept):
                raise OutputCollision(f"the output {path} is {what}; mplower does not write "
                                      f"over an input of the command")

    def staged(self, path: str | Path) -> Path | None:
        """The stage file that will become `path`, if this set has one."""
        return self._staged.get(Path(os.path.abspath(path)))

    def add(self, path: Path, tmp: Path) -> None:
        key = Path(os.path.abspath(path))
        earlier = self._staged.pop(key, None)
        if earlier is not None:
            with contextlib.suppress(OSError):
                os.unlink(earlier)
        self._staged[key] = tmp

    def stdout(self, data: bytes) -> None:
        """`data` for stdout, written after the files are in place."""
        self._stdout.append(data)

    def commit(self) -> None:
        _pause_for_test(COMMIT_PAUSE_ENV)
        for final in self._staged:  # the one rename that can fail: a folder in the way
            if final.is_dir():
                self.discard()
                raise CommitError(errno.EISDIR, os.strerror(errno.EISDIR), str(final))
        with _signals_blocked():
            while self._staged:
                final, tmp = next(iter(self._staged.items()))
                try:
                    os.replace(tmp, final)
                except OSError as e:
                    self.discard()
                    raise CommitError(e.errno, e.strerror or str(e), str(final)) from None
                del self._staged[final]
        out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
        for data in self._stdout:
            if out is None:  # a test's captured text stream
                sys.stdout.write(data.decode("utf-8"))
            else:
                sys.stdout.flush()
                out.write(data)
        sys.stdout.flush()
        self._stdout.clear()

    def discard(self) -> None:
        for tmp in self._staged.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._staged.clear()
        self._stdout.clear()


_ACTIVE: contextvars.ContextVar[OutputSet | None] = contextvars.ContextVar(
    "mplower_output_set", default=None)


@contextlib.contextmanager
def output_set() -> Iterator[OutputSet]:
    """Make a new OutputSet the one `atomic_output` stages into for the block; whatever the
    block did not `commit` is discarded when it ends. SIGTERM and SIGHUP end the block as a
    SystemExit, so that they too leave no stage file."""
    outputs = OutputSet()
    token = _ACTIVE.set(outputs)
    try:
        with _exit_on_termination():
            yield outputs
    finally:
        _ACTIVE.reset(token)
        outputs.discard()


def active_output_set() -> OutputSet | None:
    return _ACTIVE.get()


def staged_path(path: Path) -> Path:
    """What reading `path` reads now: the stage file of the active output set that will become
    `path` (a pass reads the weights an earlier pass of the same run wrote), else `path`."""
    outputs = _ACTIVE.get()
    staged = outputs.staged(path) if outputs is not None else None
    return staged if staged is not None else path


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a stage file beside `path`. Inside `output_set` it joins the set and is renamed
    into place by the set's commit; outside, it replaces `path` as soon as the block succeeds.
    Either way a block that fails leaves `path` as it was and no stage file."""
    path = Path(path)
    outputs = _ACTIVE.get()
    if outputs is not None:
        outputs.check(path)
    sweep_stale(path)
    with _exit_on_termination():
        tmp = None
        try:
            # Held back until `tmp` is assigned, so that no signal can leave the file behind.
            with _signals_blocked():
                fd, tmp = tempfile.mkstemp(prefix=stage_name(path.name), suffix=".tmp",
                                           dir=path.parent or ".")
            with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
                _pause_for_test(PAUSE_ENV)
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o777)
            else:
                os.chmod(tmp, 0o666 & ~_umask())
            if outputs is not None:
                outputs.add(path, Path(tmp))
            else:
                os.replace(tmp, path)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_output(path) as fh:
        fh.write(text)


@contextlib.contextmanager
def staged_folder(path: str | Path) -> Iterator[Path]:
    """A new folder beside `path` to build a release in; when the block succeeds it replaces
    the folder `path` whole (the old one, if any, is removed), when it fails or is terminated
    it is removed and `path` stays as it was. Missing parents of `path` are made only then."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    with _exit_on_termination():
        stage = None
        try:
            with _signals_blocked():
                stage = Path(tempfile.mkdtemp(prefix=stage_name(path.name), suffix=".tmp",
                                              dir=path.parent))
            mode = path.stat().st_mode & 0o7777 if path.is_dir() else 0o777 & ~_umask()
            os.chmod(stage, mode)  # mkdtemp's 0700 is for a folder nobody else should see
            yield stage
            _pause_for_test(COMMIT_PAUSE_ENV)
            with _signals_blocked():
                old = _swap_folders(stage, path)
                stage = old  # the previous release, removed below
        finally:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)


# renameat2(2)'s flag: exchange two paths in one step (Linux 3.15, glibc 2.28).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _swap_folders(new: Path, dest: Path) -> Path | None:
    """Put the folder `new` at `dest`; the previous `dest`, now at a stage name, is returned
    for removal (None when there was none). On Linux the two trade places in one atomic step,
    so even a SIGKILL leaves the old release or the new one; elsewhere two renames do it."""
    if not dest.exists():
        os.rename(new, dest)
        return None
    if _exchange(new, dest):
        return new
    aside = Path(tempfile.mkdtemp(prefix=stage_name(dest.name), suffix=".old", dir=dest.parent))
    os.rename(dest, aside / dest.name)
    os.rename(new, dest)
    return aside


def _exchange(a: Path, b: Path) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                     _RENAME_EXCHANGE) == 0
