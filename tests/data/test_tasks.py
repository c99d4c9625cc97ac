"""Synthetic chat tasks: disjoint deterministic splits, the answer format, JSONL round trip."""

import pytest

from ftitan.data import read_conversations
from ftitan.data.tasks import (
    TASKS,
    exact_match,
    parse_answer,
    reference_answer,
    split_of,
    task_items,
    write_task_jsonl,
)


def _questions(items):
    return {it["messages"][0]["content"] for it in items}


def _split_keys(items, task):
    on_answer = TASKS[task].split_on == "answer"
    return {reference_answer(it) if on_answer else it["messages"][0]["content"] for it in items}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_and_every_item_belongs_to_its_split(task):
    train, held = task_items(2000, seed=0, split="train", task=task), task_items(300, seed=0, split="eval", task=task)
    assert len(train) == 2000 and len(held) == 300
    assert not _questions(train) & _questions(held)
    assert not _split_keys(train, task) & _split_keys(held, task)  # sort: no held-out digit set in train
    assert {split_of(k) for k in _split_keys(train, task)} == {"train"}
    assert {split_of(k) for k in _split_keys(held, task)} == {"eval"}
    # another seed draws other items, still on the same side of the split
    assert not _split_keys(task_items(2000, seed=1, split="train", task=task), task) & _split_keys(held, task)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_items_are_deterministic_and_seeded(task):
    assert task_items(50, seed=3, split="train", task=task) == task_items(50, seed=3, split="train", task=task)
    assert task_items(50, seed=3, split="train", task=task) != task_items(50, seed=4, split="train", task=task)
    # a prefix of a longer draw: n only says where to stop
    assert task_items(20, seed=3, split="eval", task=task) == task_items(50, seed=3, split="eval", task=task)[:20]


def test_items_are_chats_with_correct_answers():
    for it in task_items(100, seed=0, split="train", task="reverse"):
        user, assistant = it["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        letters = user["content"].removeprefix("Reverse the letters: ").split(" ")
        assert 3 <= len(letters) <= 5 and len(set(letters)) == len(letters)
        assert reference_answer(it) == " ".join(reversed(letters))
    for it in task_items(100, seed=0, split="train", task="sort"):
        digits = it["messages"][0]["content"].removeprefix("Sort the digits: ").split(" ")
        assert 3 <= len(digits) <= 5 and len(set(digits)) == len(digits) and all(d.isdigit() for d in digits)
        assert reference_answer(it) == " ".join(sorted(digits))
    for it in task_items(100, seed=0, split="train", task="add"):
        a, b = it["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert reference_answer(it) == str(int(a) + int(b))


def test_item_draws_are_pinned():
    # random.Random hashes a str seed with SHA-512 (not hash()) and the split is a CRC-32: the same items
    # on every machine, Python version and PYTHONHASHSEED; a change here changes every run's data
    questions = [it["messages"][0]["content"] for it in task_items(2, seed=0, split="train", task="add")]
    assert questions == ["What is 90 + 93?", "What is 29 + 11?"]
    questions = [it["messages"][0]["content"] for it in task_items(2, seed=0, split="eval", task="reverse")]
    assert questions == ["Reverse the letters: u i q l", "Reverse the letters: j p n b"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("The answer is 95.", "95"),
        ("The answer is 0.", "0"),
        ("The answer is t a c.", "t a c"),
        ("The answer is 2 7 9.", "2 7 9"),
        ("  The answer is x y z.\n", "x y z"),
    ],
)
def test_parse_answer_accepts_the_format(text, answer):
    assert parse_answer(text) == answer


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 95",
        "the answer is 95.",
        "The answer is  95.",
        "The answer is 95. Done.",
        "So, The answer is 95.",
        "The answer is tac.",
        "The answer is t  a c.",
        "The answer is T A C.",
        "The answer is .",
        "The answer is 1 23.",
        "The answer is t,a,c.",
        "",
    ],
)
def test_parse_answer_rejects_near_misses(text):
    assert parse_answer(text) is None


def test_exact_match_compares_the_parsed_answer():
    item = {"messages": [{"role": "user", "content": "What is 37 + 58?"},
                         {"role": "assistant", "content": "The answer is 95."}]}  # fmt: skip
    assert exact_match("The answer is 95.", item)
    assert not exact_match("The answer is 96.", item)
    assert not exact_match("The answer is 95", item)


def test_jsonl_round_trips_through_read_conversations(tmp_path):
    path = write_task_jsonl(tmp_path / "sub" / "eval.jsonl", 25, seed=7, split="eval", task="reverse")
    convs = list(read_conversations(path))
    expected = task_items(25, seed=7, split="eval", task="reverse")
    assert [list(c.messages) for c in convs] == [it["messages"] for it in expected]


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="expected one of"):
        task_items(1, seed=0, split="test")
    with pytest.raises(ValueError, match="known: add, reverse, sort"):
        task_items(1, seed=0, split="train", task="copy")
