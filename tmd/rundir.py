"""Directories and files that only the job's user can change: the run directory, ``~/.trainmover``, the keys.

tmd may run as root, and what it finds in these places it trusts: ``tmd resume`` runs the command kept in
``tmd.json``. So a path that another user could create, swap or point elsewhere must never be used:

* :func:`private_dir` makes (mode 0700) or accepts a directory only when it is owned by this user and not
  writable by group or others, and when every directory above it is owned by root or this user and writable by
  nobody else (or sticky, as /tmp is: others cannot rename or delete what they do not own there), so nobody
  else can replace it after the check. It returns the resolved path: a symlink on the way is read once, here,
  and every later use goes through the checked real path.
* :func:`check_file` accepts a file only when it is a regular file (not a symlink) owned by this user and not
  writable by group or others.
* :func:`check_run_dir` accepts a run directory only when what tmd writes in it (``tmd.json``, the journal,
  ``keys/``, ``record/``, ``logs/`` and their files) is no symlink and the user's: ``O_NOFOLLOW`` guards a path's
  last component only, so a symlinked ``logs/`` would send every log elsewhere.
* :func:`trusted_dir` accepts a directory a command may run in: it and every directory above it owned by root
  or this user and writable by nobody else.
* Files are written without following a symlink: :func:`no_follow` (an ``opener`` for :func:`open`, adds
  ``O_NOFOLLOW``) and :func:`write_atomic` (a new temporary file, then ``rename``).

Every refusal raises :class:`UnsafePath` with one line naming the path and what is wrong. Only the standard
library is imported.
"""
from __future__ import annotations

import os
import pwd
import stat
import tempfile

PRIVATE = 0o022  # mode bits refused on a private directory or file: writable by group or others
SECRET = 0o077  # refused on the keys directory and key files: any access by group or others


class UnsafePath(OSError):
    """A path another user could create, change or redirect; the message (one line) says which and why."""


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _check(path: str, st: os.stat_result, what: str, loose: int, owners: tuple[int, ...]) -> None:
    if st.st_uid not in owners:
        raise UnsafePath(f"{what} {path} belongs to {_owner(st.st_uid)}, not to you ({_owner(os.geteuid())})")
    if st.st_mode & loose:
        who = "group or others" if loose == PRIVATE else "others than you"
        raise UnsafePath(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: it is open to {who}")


def _check_parents(real: str) -> None:
    """Every directory above ``real`` (resolved) is owned by root or this user and writable by nobody else, or
    sticky."""
    me = os.geteuid()
    parent = os.path.dirname(real)
    while True:
        st = os.lstat(parent)
        if stat.S_ISLNK(st.st_mode):  # realpath resolved it: changed since
            raise UnsafePath(f"{parent} became a symlink while it was checked")
        if st.st_uid not in (0, me):
            raise UnsafePath(f"{parent} (above {real}) belongs to {_owner(st.st_uid)}: that user could replace "
                             f"what is below it")
        if st.st_mode & PRIVATE and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(f"{parent} (above {real}) has mode {stat.S_IMODE(st.st_mode):04o}: another user "
                             f"could replace what is below it")
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def private_dir(path: str, what: str = "directory", create: bool = True, loose: int = PRIVATE) -> str:
    """``path`` as a directory only this user can change, resolved (see the module docstring). With ``create``,
    missing directories are made (mode 0700); without, ``path`` is one tmd made earlier and must not be a
    symlink. ``what`` names it in the error (``run directory``); ``loose``: the mode bits refused on it
    (:data:`PRIVATE`, or :data:`SECRET` for the keys). Raises :class:`UnsafePath` (also when it does not exist
    and ``create`` is false)."""
    path = os.path.abspath(path)
    if not create and os.path.islink(path):
        raise UnsafePath(f"{what} {path} is a symlink")
    if create:
        missing = []
        head = path
        while not os.path.lexists(head):
            missing.append(head)
            head = os.path.dirname(head)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass  # made meanwhile: checked below like any existing one
    return _resolved_dir(path, what, loose, (os.geteuid(),))


def _resolved_dir(path: str, what: str, loose: int, owners: tuple[int, ...]) -> str:
    """``path`` resolved, when it is a directory owned by one of ``owners`` without ``loose``'s mode bits and the
    directories above it pass :func:`_check_parents`."""
    real = os.path.realpath(path)
    try:
        st = os.lstat(real)
        _check_parents(real)
    except FileNotFoundError:
        raise UnsafePath(f"{what} {path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    _check(path, st, what, loose, owners)
    return real


def check_file(path: str, what: str = "file", loose: int = PRIVATE) -> None:
    """Refuse ``path`` unless it is a regular file (not a symlink) owned by this user, with none of ``loose``'s
    mode bits. Raises :class:`UnsafePath`; FileNotFoundError when it does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} {path} is a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a regular file")
    _check(path, st, what, loose, (os.geteuid(),))


def check_inside(real: str, dirs: tuple[tuple[str, str, str, int], ...], files: tuple[tuple[str, str], ...]) -> None:
    """Refuse a path inside the checked directory ``real`` (:func:`private_dir`'s, resolved) through which tmd
    would write elsewhere, or write to what another user controls (``O_NOFOLLOW`` covers only a path's last
    component: ``logs`` a symlink would send every log elsewhere). ``dirs``: (relative path, what it is, what
    its files are, the mode bits refused on both), a parent before what is in it: each that exists must be a
    directory of this user's and no symlink (:func:`private_dir` without ``create``), and each entry in it a
    regular file of this user's (:func:`check_file`) unless it is one of ``dirs``. ``files``: (relative path, what
    it is): each that exists must be a regular file of this user's. Raises :class:`UnsafePath`."""
    for rel, what in files:
        path = os.path.join(real, rel)
        if os.path.lexists(path):
            check_file(path, what)
    inner = {os.path.join(real, rel) for rel, *_ in dirs}
    for rel, what, entries, loose in dirs:
        path = os.path.join(real, rel)
        if not os.path.lexists(path):
            continue
        private_dir(path, what, create=False, loose=loose)
        for entry in os.scandir(path):
            if entry.path not in inner:
                check_file(entry.path, entries, loose=loose)


def check_run_dir(real: str, keys_loose: int = PRIVATE) -> None:
    """Refuse the run directory ``real`` (:func:`private_dir`'s, resolved) when what tmd writes in it is a symlink,
    not a regular file or directory, or another user's (:func:`check_inside`): ``tmd.json``, the journal, the
    ``keys`` directory and its ``worker/`` (``keys_loose``: the mode bits refused there), ``record/``, ``logs/``,
    and the files in those directories. Raises :class:`UnsafePath`."""
    from tmd.protocol.keys import WORKER_DIR
    from tmd.protocol.layout import RunDir

    keys = "keys"  # (tmd.daemon's default keys directory)
    check_inside(real, dirs=((keys, "keys directory", "key file", keys_loose),
                             (os.path.join(keys, WORKER_DIR), "keys directory", "key file", keys_loose),
                             (RunDir.RECORD, "recordings directory", "recording", PRIVATE),
                             (RunDir.LOGS, "logs directory", "log file", PRIVATE)),
                 files=((RunDir.TMD_JSON, "tmd.json"), (RunDir.EVENTS, "journal")))


def trusted_dir(path: str, what: str = "directory") -> str:
    """``path`` resolved, when it and every directory above it are owned by root or this user and writable by
    nobody else (a command run there imports and reads what only they can have put there). Raises
    :class:`UnsafePath`."""
    return _resolved_dir(path, what, PRIVATE, (0, os.geteuid()))


def no_follow(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open`: ``os.open`` with ``O_NOFOLLOW`` (a symlink at ``path`` fails with
    OSError ELOOP) and mode 0600 for a file it creates."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with a file holding ``data`` (``mode``): written to a new temporary file in the same
    directory (never an existing file, never through a symlink), then renamed over ``path`` (a symlink there is
    replaced, not followed). Readers see the old file or the new one, never a part."""
    d, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
