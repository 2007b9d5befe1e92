"""A spec file read from disk (common/spec/file.py): only a regular file, at most
MAX_SPEC_BYTES, and TOML too deeply nested to parse is one error line, not a traceback.
Before: `rlfleet job validate /dev/zero` read 3.5 GB in 8 s, a FIFO blocked it forever,
and a 100k-deep array ended in a RecursionError (exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.file import MAX_SPEC_BYTES
from rlfleet.common.spec.job import load_spec
from rlfleet.tools.exit_codes import Exit

CLI = [sys.executable, "-m", "rlfleet.tools.cli"]


def errors_of(path: Path | str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value.errors


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    os.mkfifo(path)
    return path


def test_validate_refuses_a_fifo_and_a_device_at_once(fifo):
    done = subprocess.run([*CLI, "job", "validate", str(fifo), "/dev/zero"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == Exit.BAD_SPEC
    assert done.stderr == (f"{fifo}: cannot read: it is a FIFO, not a regular file\n"
                           "/dev/zero: cannot read: it is a character device, not a regular file\n")


@pytest.mark.parametrize("command", [["job", "submit", "{spec}", "--etcd", "127.0.0.1:1"],
                                     ["run", "{spec}"],
                                     ["daemon", "rollout", "--job", "t", "--spec", "{spec}"]],
                         ids=lambda c: " ".join(c[:2]))
def test_every_command_that_reads_a_spec_file_refuses_a_fifo(fifo, command):
    done = subprocess.run([*CLI, *(arg.format(spec=fifo) for arg in command)],
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (Exit.BAD_SPEC,
                                              f"{fifo}: cannot read: it is a FIFO, not a regular file\n")


def test_a_directory_is_named_as_one(tmp_path):
    assert errors_of(tmp_path) == [f"{tmp_path}: cannot read: it is a directory, not a regular file"]


def test_a_spec_above_the_cap_is_refused_with_its_size(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (MAX_SPEC_BYTES + 1))  # a comment: valid TOML, so only the cap refuses it
    assert errors_of(path) == [f"{path}: cannot read: {MAX_SPEC_BYTES + 1} bytes, more than a spec "
                               f"may have ({MAX_SPEC_BYTES} bytes)"]
    path.write_bytes(b"#" * MAX_SPEC_BYTES)  # at the cap: read, and then validated
    assert errors_of(path)[0] == f"{path}: job.name: required key missing"


def test_nesting_too_deep_to_parse_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert errors_of(path) == [
        f"{path}: invalid TOML: arrays or inline tables nested too deeply to parse (Python's recursion "
        f"limit is {sys.getrecursionlimit()} frames; a job spec nests a few levels)"]
    done = subprocess.run([*CLI, "job", "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == Exit.BAD_SPEC
    assert done.stderr.count("\n") == 1 and "nested too deeply" in done.stderr, done.stderr
