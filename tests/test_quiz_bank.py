"""The question bank: every file matches the schema, the counts the curriculum asks for, no duplicates,
and a malformed file is reported by file and question."""

from __future__ import annotations

import collections
import copy
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from distlab import quiz


def _bank_files() -> list[Any]:
    folder = resources.files("distlab.quiz").joinpath("bank")
    return sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)


def _raw(topic: str) -> dict[str, Any]:
    return json.loads(resources.files("distlab.quiz").joinpath("bank", f"{topic}.json").read_text(encoding="utf-8"))


def test_the_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(quiz.schema())
    assert quiz.schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("file", _bank_files(), ids=lambda f: f.name)
def test_every_bank_file_matches_the_schema(file):
    jsonschema.Draft202012Validator(quiz.schema()).validate(json.loads(file.read_text(encoding="utf-8")))


def test_there_is_one_file_per_topic_and_nothing_else():
    assert [f.name for f in _bank_files()] == sorted(f"{topic}.json" for topic in quiz.TOPICS)


def test_topics_are_the_fifteen_of_the_curriculum_in_order():
    assert list(quiz.TOPICS)[:3] == ["why-distribute", "training-round", "data-parallelism"]
    assert list(quiz.TOPICS)[-1] == "scaling"
    assert len(quiz.TOPICS) == 15


def test_each_topic_has_at_least_six_questions_and_the_bank_a_hundred():
    per_topic = collections.Counter(q.topic for q in quiz.bank())
    assert set(per_topic) == set(quiz.TOPICS)
    assert min(per_topic.values()) >= 6
    assert len(quiz.bank()) >= 100


def test_at_least_a_third_of_the_questions_are_numeric():
    kinds = collections.Counter(q.kind for q in quiz.bank())
    assert kinds["numeric"] * 3 >= len(quiz.bank())


def test_every_kind_of_question_is_in_the_bank():
    assert {q.kind for q in quiz.bank()} == {"single", "multiple", "numeric", "ordering", "live"}
    assert {q.difficulty for q in quiz.bank()} == set(quiz.DIFFICULTIES)


def test_bank_iterates_over_questions_with_the_documented_fields():
    for question in quiz.bank():
        assert question.id.startswith(question.topic + "/")
        assert question.topic in quiz.TOPICS
        assert question.kind in {"single", "multiple", "numeric", "ordering", "live"}
        assert question.difficulty in quiz.DIFFICULTIES
        assert question.prompt.strip() and question.hint.strip() and question.explanation.strip()


def test_no_two_questions_share_an_id_or_a_prompt():
    # Read the files directly, so the check does not depend on the loader doing it.
    ids, prompts = [], []
    for file in _bank_files():
        for raw in json.loads(file.read_text(encoding="utf-8"))["questions"]:
            ids.append(raw["id"])
            prompts.append(re.sub(r"\W+", " ", raw["prompt"]).strip().lower())
    assert len(ids) == len(set(ids))
    assert len(prompts) == len(set(prompts))


def test_no_question_repeats_an_option():
    for question in quiz.bank():
        options = getattr(question, "options", ()) or getattr(question, "items", ())
        texts = [o.text for o in options]
        assert len(texts) == len(set(texts)), question.id


def test_numeric_answers_name_theory_functions_never_typed_numbers():
    for file in _bank_files():
        for raw in json.loads(file.read_text(encoding="utf-8"))["questions"]:
            if raw["kind"] == "numeric":
                assert set(raw["answer"]) == {"theory", "params"}, raw["id"]


def test_bank_get_finds_a_question_and_names_close_ids_when_it_cannot():
    question = quiz.bank().get("communication-cost/ring-allreduce-time")
    assert question.kind == "numeric"
    with pytest.raises(KeyError, match="did you mean 'communication-cost/ring-allreduce-time'"):
        quiz.bank().get("communication-cost/ring-allreduce-tme")


def test_the_package_bank_is_loaded_once():
    assert quiz.bank() is quiz.bank()


# --- malformed files ------------------------------------------------------------------------------


def _write(folder: Path, topic: str, questions: list[dict[str, Any]], name: str | None = None) -> None:
    (folder / (name or f"{topic}.json")).write_text(
        json.dumps({"topic": topic, "questions": questions}), encoding="utf-8"
    )


def _question(topic: str, index: int) -> dict[str, Any]:
    return copy.deepcopy(_raw(topic)["questions"][index])


def _first_of_kind(topic: str, kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(q for q in _raw(topic)["questions"] if q["kind"] == kind))


def test_a_valid_copy_of_a_file_loads(tmp_path):
    _write(tmp_path, "pitfalls", _raw("pitfalls")["questions"])
    assert len(quiz.load_bank(tmp_path)) == len(_raw("pitfalls")["questions"])


def test_broken_json_names_the_file_and_the_line(tmp_path):
    (tmp_path / "scaling.json").write_text('{"topic": "scaling",\n "questions": [,]}', encoding="utf-8")
    with pytest.raises(quiz.BankError, match=r"^scaling\.json: not valid JSON at line 2"):
        quiz.load_bank(tmp_path)


def test_a_schema_error_names_the_file_the_question_and_the_field(tmp_path):
    broken = _question("scaling", 0)
    del broken["hint"]
    _write(tmp_path, "scaling", [broken])
    with pytest.raises(
        quiz.BankError, match=r"^scaling\.json, question 'scaling/parallel-efficiency': 'hint' is a required property"
    ):
        quiz.load_bank(tmp_path)


def test_a_question_without_an_id_is_named_by_its_position(tmp_path):
    good, broken = _question("scaling", 0), _question("scaling", 1)
    del broken["id"]
    _write(tmp_path, "scaling", [good, broken])
    with pytest.raises(quiz.BankError, match=r"scaling\.json, question #2: 'id' is a required property"):
        quiz.load_bank(tmp_path)


def test_an_unknown_field_is_refused(tmp_path):
    broken = _first_of_kind("pitfalls", "single")
    broken["answer"] = "a"
    _write(tmp_path, "pitfalls", [broken])
    with pytest.raises(quiz.BankError, match=r"pitfalls\.json, question 'pitfalls/collective-behind-if'.*'answer'"):
        quiz.load_bank(tmp_path)


def test_a_single_choice_question_with_two_right_options_is_refused(tmp_path):
    broken = _first_of_kind("pitfalls", "single")
    for option in broken["options"][:2]:
        option["correct"] = True
    _write(tmp_path, "pitfalls", [broken])
    with pytest.raises(
        quiz.BankError, match=r"question 'pitfalls/collective-behind-if': .*exactly one right option \(found 2\)"
    ):
        quiz.load_bank(tmp_path)


def test_a_multiple_choice_question_with_only_right_options_is_refused(tmp_path):
    broken = _first_of_kind("pitfalls", "multiple")
    for option in broken["options"]:
        option["correct"] = True
    _write(tmp_path, "pitfalls", [broken])
    with pytest.raises(quiz.BankError, match="needs right and wrong options"):
        quiz.load_bank(tmp_path)


@pytest.mark.parametrize("name", ["no_such_function", "_number", "dimensions", "UNITS", "LatencyBandwidthFit"])
def test_a_numeric_answer_must_name_a_public_theory_function(tmp_path, name):
    # Lower-case names reach the loader's check; others already fail the schema's name pattern.
    broken = _first_of_kind("scaling", "numeric")
    broken["answer"]["theory"] = name
    _write(tmp_path, "scaling", [broken])
    with pytest.raises(quiz.BankError, match=rf"scaling\.json, question '{broken['id']}': .*'{name}'"):
        quiz.load_bank(tmp_path)


def test_parameters_that_do_not_fit_the_theory_function_are_refused(tmp_path):
    broken = _question("communication-cost", 0)
    broken["answer"]["params"]["world"] = broken["answer"]["params"].pop("workers")
    _write(tmp_path, "communication-cost", [broken])
    with pytest.raises(quiz.BankError, match=r"the parameters do not fit ring_allreduce_time_s\(size_bytes, workers"):
        quiz.load_bank(tmp_path)


def test_a_unit_of_the_wrong_dimension_is_refused(tmp_path):
    answer_unit = _question("communication-cost", 0)
    answer_unit["unit"] = "MB"
    _write(tmp_path, "communication-cost", [answer_unit])
    with pytest.raises(
        quiz.BankError, match="unit 'MB' is for a size in bytes, but ring_allreduce_time_s returns a time"
    ):
        quiz.load_bank(tmp_path)

    param_unit = _question("communication-cost", 0)
    param_unit["answer"]["params"]["latency_s"]["unit"] = "GB"
    _write(tmp_path, "communication-cost", [param_unit])
    with pytest.raises(quiz.BankError, match="parameter 'latency_s' is a time by its name, but its unit 'GB'"):
        quiz.load_bank(tmp_path)


def test_an_unknown_unit_is_refused(tmp_path):
    broken = _question("communication-cost", 0)
    broken["unit"] = "millis"
    _write(tmp_path, "communication-cost", [broken])
    with pytest.raises(quiz.BankError, match="unknown unit 'millis'"):
        quiz.load_bank(tmp_path)


def test_a_placeholder_that_names_no_parameter_is_refused(tmp_path):
    broken = _question("communication-cost", 0)
    broken["prompt"] += " (with {nodes} nodes)"
    _write(tmp_path, "communication-cost", [broken])
    with pytest.raises(quiz.BankError, match=r"prompt uses \{nodes\}, which is not one of"):
        quiz.load_bank(tmp_path)


def test_a_mistake_that_sets_an_unknown_parameter_is_refused(tmp_path):
    broken = _question("communication-cost", 0)
    broken["mistakes"] = [{"set": {"nodes": 1}, "feedback": "x"}]
    _write(tmp_path, "communication-cost", [broken])
    with pytest.raises(quiz.BankError, match="a mistake sets 'nodes'"):
        quiz.load_bank(tmp_path)


def test_live_code_that_does_not_compile_is_refused_at_load_time(tmp_path):
    broken = _first_of_kind("data-parallelism", "live")
    broken["code"] = ["t = torch.tensor([1.0]", "t.item()"]
    _write(tmp_path, "data-parallelism", [broken])
    with pytest.raises(quiz.BankError, match=rf"question '{broken['id']}': code: "):
        quiz.load_bank(tmp_path)


def test_live_code_must_end_with_the_expression_it_checks(tmp_path):
    broken = _first_of_kind("data-parallelism", "live")
    broken["code"] = ["t = torch.tensor([1.0])", "dist.all_reduce(t)", "value = t.item()"]
    _write(tmp_path, "data-parallelism", [broken])
    with pytest.raises(quiz.BankError, match="must end with an expression"):
        quiz.load_bank(tmp_path)


def test_a_live_rank_beyond_the_smallest_lab_is_refused(tmp_path):
    broken = _first_of_kind("torch-distributed-api", "live")
    broken["rank"] = 2
    _write(tmp_path, "torch-distributed-api", [broken])
    with pytest.raises(quiz.BankError, match="rank 2 does not exist in a lab of min_world_size 2"):
        quiz.load_bank(tmp_path)


def test_a_file_must_be_named_after_its_topic(tmp_path):
    _write(tmp_path, "scaling", [_question("scaling", 0)], name="scale.json")
    with pytest.raises(
        quiz.BankError,
        match=re.escape("scale.json: a file holds one topic and is named after it: rename it scaling.json"),
    ):
        quiz.load_bank(tmp_path)


def test_an_unknown_topic_is_refused(tmp_path):
    question = _question("scaling", 0)
    question["id"] = "cooking/parallel-efficiency"
    _write(tmp_path, "cooking", [question])
    with pytest.raises(quiz.BankError, match=re.escape("cooking.json: unknown topic 'cooking'")):
        quiz.load_bank(tmp_path)


def test_ids_must_start_with_the_topic(tmp_path):
    question = _question("scaling", 0)
    question["id"] = "pitfalls/parallel-efficiency"
    _write(tmp_path, "scaling", [question])
    with pytest.raises(quiz.BankError, match=re.escape("ids in scaling.json start with 'scaling/'")):
        quiz.load_bank(tmp_path)


def test_the_same_id_in_two_files_is_refused(tmp_path):
    first = _question("scaling", 0)
    second = _question("pitfalls", 0)
    second["id"] = "pitfalls/" + first["id"].split("/")[1]
    first["id"] = second["id"].replace("pitfalls/", "scaling/")
    _write(tmp_path, "scaling", [first])
    twin = copy.deepcopy(first)
    _write(tmp_path, "pitfalls", [second, twin | {"id": second["id"]}])
    with pytest.raises(quiz.BankError, match="the id is used twice"):
        quiz.load_bank(tmp_path)


def test_the_same_prompt_twice_is_refused(tmp_path):
    first, second = _question("scaling", 0), _question("scaling", 1)
    second["prompt"] = first["prompt"].replace(" ", "  ") + "!"
    second["answer"] = first["answer"]
    second["unit"] = first["unit"]
    _write(tmp_path, "scaling", [first, second])
    with pytest.raises(quiz.BankError, match="the same prompt as question 'scaling/parallel-efficiency'"):
        quiz.load_bank(tmp_path)


def test_an_empty_folder_is_refused(tmp_path):
    with pytest.raises(quiz.BankError, match="no question files"):
        quiz.load_bank(tmp_path)
