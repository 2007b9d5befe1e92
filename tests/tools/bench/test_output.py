"""tools/bench/output.py: what every benchmark record starts with, and records written whole."""

from __future__ import annotations

import json

from rlfleet.tools.bench import output


def test_provenance_names_the_command_the_code_and_the_machine():
    made = output.provenance("rlfleet.tools.bench.x", ["--runs", "3"])
    assert made["command"] == "python -m rlfleet.tools.bench.x --runs 3"
    assert len(made["commit"]) == 40 and isinstance(made["uncommitted_changes"], list)
    assert " cores " in made["machine"] and made["date"][:2] == "20"


def test_every_record_says_what_made_it_unless_it_is_older_than_that_rule():
    for path in sorted(output.REPO.joinpath("tools", "bench", "results").glob("*.json")):
        if path.name in output.LEGACY_RECORDS:
            continue
        record = json.loads(path.read_text())
        missing = [k for k in output.PROVENANCE if not (isinstance(record, dict) and record.get(k))]
        assert not missing, f"tools/bench/results/{path.name} lacks {missing} (tools/bench/output.provenance)"


def test_write_json_replaces_the_record_whole(tmp_path):
    path = tmp_path / "deep" / "r.json"
    output.write_json(path, {"runs": [1]})
    output.write_json(path, {"runs": [1, 2]})
    assert json.loads(path.read_text()) == {"runs": [1, 2]} and [p.name for p in path.parent.iterdir()] == ["r.json"]
