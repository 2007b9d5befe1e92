"""A job spec read from disk: a regular file of at most MAX_SPEC_BYTES, UTF-8 TOML.

Every command that takes a spec file (`rlfleet job validate|submit`, `rlfleet run`,
`rlfleet daemon --spec`, a daemon's SIGHUP reload) reads it through ``read_spec_toml``,
so none of them can be kept waiting by a FIFO or fill its memory from /dev/zero: what
is not a regular file is refused before a byte is read, and no more than the cap (plus
the byte that shows it was exceeded) is ever read.
"""

from __future__ import annotations

import os
import stat
import sys
import tomllib

from rlfleet.common.spec.errors import SpecError, toml_error

__all__ = ["MAX_SPEC_BYTES", "read_spec_toml"]

# The largest shipped spec is about 4 KiB; a user_code reward's inline source fits many times over.
MAX_SPEC_BYTES = 1 << 20

_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def read_spec_toml(path: str | os.PathLike) -> dict:
    """The TOML table in ``path``; SpecError (one line naming the file) when it cannot be had."""
    source = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once (then refused below)
        # instead of waiting for one; a regular file reads the same either way.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SpecError([f"{source}: cannot read: {e.strerror or e}"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = next((name for test, name in _FILE_TYPES if test(st.st_mode)), stat.filemode(st.st_mode))
            raise SpecError([f"{source}: cannot read: it is {what}, not a regular file"])
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError([f"{source}: cannot read: {st.st_size} bytes, more than a spec may have "
                             f"({MAX_SPEC_BYTES} bytes)"])
        # st_size can be 0 for content the kernel makes up (/proc) or lag a file still growing.
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([f"{source}: cannot read: more than {MAX_SPEC_BYTES} bytes (the most a spec may "
                         f"have), though its size said {st.st_size}"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError([f"{source}: invalid TOML: not UTF-8 ({e.reason})"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError([f"{source}: {toml_error(str(e))}"]) from None
    except RecursionError:
        # tomllib parses arrays and inline tables recursively: a few hundred levels exhaust
        # the interpreter's stack long before the file reaches the size cap.
        raise SpecError([f"{source}: invalid TOML: arrays or inline tables nested too deeply to parse "
                         f"(Python's recursion limit is {sys.getrecursionlimit()} frames; a job spec nests "
                         "a few levels)"]) from None

