"""Secrets come from files only, and only from files their owner alone can read.

A secret on a command line shows in `ps`; one in the environment shows in
/proc/<pid>/environ and in every child. A file other users can read authenticates
nobody, so a group- or world-accessible one is refused with the chmod that fixes it,
never used with a warning.
"""

from __future__ import annotations

import os
import stat


class SecretFileError(ValueError):
    """A secret file cannot be used; the message names the file and why."""


def read_private(path: str | os.PathLike[str], what: str, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path`` (``what`` names it in errors: "etcd password file").

    Refused unless it is a regular file with no group or other permission bits
    (0600, 0400); a symlink is followed only to check the file it names."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow_symlinks else os.O_NOFOLLOW))
    except OSError as exc:
        raise SecretFileError(f"{what} {path}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)  # the file actually opened, not what the name points to later
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{what} {path}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise SecretFileError(f"{what} {path}: mode {mode:04o} lets group or others read it; "
                                  f"it must be 0600 or stricter (chmod 600 {path})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Create ``path`` with mode 0600 from the start (no window in which it is readable)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)
