"""The shared reward service's answer journal: read back after a kill, torn and bad
lines skipped, bounded by rewrites, one service per file."""

from __future__ import annotations

import pytest

from rlfleet.daemons.reward_host.shared.answer_journal import AnswerJournal, JournalUnusable


def entry(i: int) -> tuple[tuple[str, str], tuple[int, bytes]]:
    return (f"job-{i % 2}", f"p{i}-g0"), (200, b'{"reward": %d.0}' % (i % 2))


def test_answers_come_back_in_order_after_a_reopen(tmp_path):
    journal = AnswerJournal(tmp_path / "answers.jsonl", keep=100)
    journal.append([entry(0), entry(1)])
    journal.append([(("job-0", "bad"), (422, b'{"error": "stage \'check\': boom"}'))])
    journal.close()
    again = AnswerJournal(tmp_path / "answers.jsonl", keep=100)
    assert list(again.loaded.items()) == [entry(0), entry(1),
                                          (("job-0", "bad"), (422, b'{"error": "stage \'check\': boom"}'))]
    assert again.skipped == 0
    again.close()


def test_a_torn_last_line_and_bad_lines_are_skipped_and_the_file_is_clean_after(tmp_path, caplog):
    path = tmp_path / "answers.jsonl"
    journal = AnswerJournal(path, keep=100)
    journal.append([entry(0), entry(1)])
    journal.close()
    with open(path, "ab") as f:  # what kill -9 mid-write and a stray editor leave
        f.write(b'[1, 2]\n{"tenant": "job-0", "id": 7, "status": 200, "body": "{}"}\n'
                b'{"tenant": "job-0", "id": "x", "status": 500, "body": "{}"}\n{"tenant": "jo')
    again = AnswerJournal(path, keep=100)
    assert list(again.loaded.items()) == [entry(0), entry(1)] and again.skipped == 4
    assert "line 3 skipped" in caplog.text and "line 6 skipped" in caplog.text
    again.close()
    assert len(path.read_bytes().splitlines()) == 2  # rewritten with the good lines only


def test_the_newest_keep_answers_are_kept_and_the_file_stays_bounded(tmp_path):
    path = tmp_path / "answers.jsonl"
    journal = AnswerJournal(path, keep=3)
    kept: dict = {}
    for i in range(20):  # as the scorer does: append, then rewrite with its record when told
        journal.append([entry(i)])
        kept[entry(i)[0]] = entry(i)[1]
        while len(kept) > 3:
            kept.pop(next(iter(kept)))
        if journal.needs_rewrite:
            journal.rewrite(kept.items())
        assert len(path.read_bytes().splitlines()) < 2 * 3
    journal.close()
    assert list(AnswerJournal(path, keep=3).loaded.items()) == [entry(17), entry(18), entry(19)]


def test_a_second_service_cannot_take_the_same_journal(tmp_path):
    journal = AnswerJournal(tmp_path / "answers.jsonl", keep=10)
    with pytest.raises(JournalUnusable, match="answers.jsonl: in use by another reward service"):
        AnswerJournal(tmp_path / "answers.jsonl", keep=10)
    journal.close()
    AnswerJournal(tmp_path / "answers.jsonl", keep=10).close()  # free again once closed


def test_an_unwritable_place_is_a_precise_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(JournalUnusable, match=r"file/sub/answers.jsonl: Not a directory"):
        AnswerJournal(tmp_path / "file" / "sub" / "answers.jsonl", keep=10)
