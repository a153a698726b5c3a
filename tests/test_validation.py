"""A validation error as an operator reads it (issue 33): every problem, one a line, bounded —
20 problems at most, each line cut at 160 characters, "and N more" when the list was cut — and
a decision written by hand starts from the model's last output or the schema's example."""

import pydantic
import pytest
from pydantic import BaseModel, Field, create_model

from recovery.validation import (
    MAX_PROBLEM_CHARS,
    fields_of,
    one_line,
    problem_count,
    problem_text,
    problems_of,
    skeleton,
)

Wide = create_model("Wide", **{f"field_{i:02}": (int, ...) for i in range(25)})


class Small(BaseModel):
    category: str = Field(pattern="^(office|travel)$")
    amount: int = Field(ge=0)
    note: str = Field(default="-", max_length=20)


def error_of(schema, value) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as caught:
        schema.model_validate(value)
    return caught.value


def test_a_long_list_of_problems_is_cut_at_twenty_and_says_how_many_more():
    text = problem_text("model output does not match Wide", problems_of(error_of(Wide, {})))
    lines = text.split("\n")
    assert lines[0] == "model output does not match Wide: 25 problems"
    assert lines[1] == "- field_00: Field required" and lines[20] == "- field_19: Field required"
    assert lines[21:] == ["- … and 5 more"]
    assert problem_count(text) == 25
    assert len(text) < 4000  # within the step's error column


def test_each_problem_names_what_was_given_and_a_long_line_is_cut():
    problems = problems_of(error_of(Small, {"category": "bribes" * 40, "amount": -1}))
    assert problems[1] == "amount: Input should be greater than or equal to 0 (given: -1)"
    text = problem_text("x", problems)
    assert all(len(line) <= MAX_PROBLEM_CHARS for line in text.split("\n"))
    assert one_line(text).startswith("x: category: String should match pattern")
    assert "\n" not in one_line(text)


def test_an_error_stored_before_the_list_names_no_count():
    assert problem_count("model output does not match X: 5 validation errors for X\ncategory\n  Field required") is None
    assert problems_of(ValueError("Expecting value: line 1 column 1 (char 0)")) == [
        "not JSON: Expecting value: line 1 column 1 (char 0)"
    ]


def test_a_hand_written_decision_starts_from_the_last_output_or_the_schemas_example():
    assert skeleton(Small, '{"category": "bribes"}') == {"category": "bribes", "amount": 0, "note": "-"}
    assert skeleton(Small, "not json") == {"category": "", "amount": 0, "note": "-"}
    assert skeleton(Small, '["a list"]') == {"category": "", "amount": 0, "note": "-"}
    assert [(f["name"], f["type"], f["required"]) for f in fields_of(Small)] == [
        ("category", "string (matching ^(office|travel)$)", True),
        ("amount", "integer (≥ 0)", True),
        ("note", "string (at most 20 characters)", False),
    ]
