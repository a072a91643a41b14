"""Quiz progress: where it lives, atomic saves, and mastery per topic."""

from __future__ import annotations

import json
import os

import pytest

from distlab import quiz
from distlab.quiz.progress import Progress


def test_progress_lives_in_the_jupyter_data_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTLAB_QUIZ_PROGRESS")
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    assert quiz.progress_path() == tmp_path / "jupyter" / "distlab" / "quiz-progress.json"


def test_the_environment_variable_names_a_folder_or_a_file(tmp_path, monkeypatch):
    assert quiz.progress_path() == tmp_path / "quiz-progress.json"
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(tmp_path / "mine.json"))
    assert quiz.progress_path() == tmp_path / "mine.json"


def test_recording_an_answer_writes_the_file_and_its_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_QUIZ_PROGRESS", str(tmp_path / "deep" / "er" / "progress.json"))
    Progress().record("scaling/speed-up", True)
    data = json.loads((tmp_path / "deep" / "er" / "progress.json").read_text(encoding="utf-8"))
    assert data["questions"]["scaling/speed-up"]["right"] == 1
    assert os.listdir(tmp_path / "deep" / "er") == ["progress.json"]  # no temporary file left behind


def test_each_answer_counts_and_the_last_one_decides_mastery():
    progress = Progress()
    progress.record("scaling/speed-up", True)
    progress.record("scaling/speed-up", False)
    entry = progress.record("scaling/speed-up", True)
    assert (entry.attempts, entry.right, entry.last_right) == (3, 2, True)
    progress.record("scaling/speed-up", False)
    assert not progress.mastered("scaling/speed-up")


def test_two_kernels_recording_in_turn_keep_each_others_answers():
    first, second = Progress(), Progress()
    first.record("scaling/speed-up", True)
    second.record("scaling/amdahl", True)
    assert set(Progress().records) == {"scaling/speed-up", "scaling/amdahl"}


def test_a_failed_save_leaves_the_old_file_whole(monkeypatch):
    progress = Progress()
    progress.record("scaling/speed-up", True)
    before = quiz.progress_path().read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        progress.record("scaling/amdahl", True)
    assert quiz.progress_path().read_bytes() == before
    assert os.listdir(quiz.progress_path().parent) == ["quiz-progress.json"]


def test_an_unreadable_file_is_kept_aside_and_progress_starts_afresh():
    quiz.progress_path().write_text("{not json", encoding="utf-8")
    with pytest.warns(UserWarning, match="quiz progress in .* was unreadable"):
        progress = Progress()
    assert progress.records == {}
    kept = [name for name in os.listdir(quiz.progress_path().parent) if ".unreadable-" in name]
    assert len(kept) == 1
    assert (quiz.progress_path().parent / kept[0]).read_text(encoding="utf-8") == "{not json"


def test_summary_shows_every_topic_in_curriculum_order_then_the_exercises_checked():
    assert "Exercises" not in str(quiz.summary())  # none checked yet
    Progress().record_exercise("ring-allreduce", False)
    Progress().record_exercise("average-gradients", True)
    summary = quiz.summary()
    assert [row.topic for row in summary.topics] == list(quiz.TOPICS)
    assert all(row.questions == len(quiz.bank().select(row.topic)) for row in summary.topics)
    lines = str(summary).splitlines()
    assert str(quiz.progress_path()) in lines[0]
    assert lines.index("") == 2 + len(quiz.TOPICS)  # then the exercises
    assert lines[lines.index("") + 1] == "Exercises: 1 of 2 passed"
    assert [row.name for row in summary.exercises] == ["average-gradients", "ring-allreduce"]  # by name
    assert repr(summary) == str(summary)


def test_mastery_is_the_share_of_a_topics_questions_last_answered_right():
    progress = Progress()
    questions = quiz.bank().select("scaling")
    progress.record(questions[0].id, True)
    progress.record(questions[1].id, False)
    row = quiz.summary()["scaling"]
    assert (row.answered, row.mastered) == (2, 1)
    assert row.mastery == pytest.approx(1 / len(questions))
    assert f"{row.mastery:.0%}" in str(quiz.summary())


def test_progress_for_questions_no_longer_in_the_bank_is_ignored():
    Progress().record("scaling/a-question-that-was-removed", True)
    assert quiz.summary()["scaling"].answered == 0


def test_summary_of_an_unknown_topic_lists_the_topics():
    with pytest.raises(KeyError, match="no topic 'cooking'; topics: why-distribute"):
        quiz.summary()["cooking"]
