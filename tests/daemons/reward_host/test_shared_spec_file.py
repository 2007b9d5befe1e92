"""The shared reward service's spec file is read as a job spec is (common/spec/file.py):
it used to be read whole, whatever it was, before anything checked it."""

from __future__ import annotations

import os

import pytest

from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.file import MAX_SPEC_BYTES
from rlfleet.daemons.reward_host.shared.spec import load_service_spec


def test_a_fifo_a_folder_and_a_huge_file_are_refused_at_once(tmp_path):
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (MAX_SPEC_BYTES + 1))
    for path, why in ((fifo, "it is a FIFO, not a regular file"), (tmp_path, "it is a directory"),
                      (huge, f"more than a spec may have \\({MAX_SPEC_BYTES} bytes\\)")):
        with pytest.raises(SpecError, match=why):
            load_service_spec(path)
