"""kvscope.lessons' core: the sentence under an output, the still of a key moment, the check of an exercise.
Outside a notebook they print plain text, which is what these tests read."""
from __future__ import annotations

import pytest

from kvscope import lessons


def test_say_prints_the_sentence_and_refuses_an_empty_one(capsys):
    lessons.say("13 cells are used: one per prompt token.")
    assert capsys.readouterr().out == "-> 13 cells are used: one per prompt token.\n"
    with pytest.raises(ValueError, match="sentence"):
        lessons.say("  ")


def test_check_says_right_wrong_or_reveals(capsys):
    assert lessons.check(13, 13, why="one cell per token") is True
    assert "Right: one cell per token" in capsys.readouterr().out
    assert lessons.check(12, 13, why="one cell per token") is False
    out = capsys.readouterr().out
    assert "Not quite: you said 12, the engine says 13" in out
    assert lessons.check(..., 13, why="one cell per token") is None
    assert "the answer: 13: one cell per token" in capsys.readouterr().out


def test_check_compares_numbers_within_a_tolerance_and_sets_in_any_order():
    assert lessons.check(0.70, 0.75, why="", tolerance=0.1) is True
    assert lessons.check(0.60, 0.75, why="", tolerance=0.1) is False
    assert lessons.check([3, 1, 2], {1, 2, 3}, why="") is True
    assert lessons.check([1, 2], [2, 1], why="") is False  # a list's order counts
    assert lessons.check("many", 3, why="", tolerance=1) is False  # not a number: wrong, not a crash


def test_picture_says_the_caption_and_renders_only_when_asked(monkeypatch, capsys):
    go = pytest.importorskip("plotly.graph_objects")
    figure = go.Figure(go.Bar(y=[1, 2]))
    monkeypatch.delenv(lessons.PICTURES_ENV, raising=False)
    assert not lessons.rendering()
    lessons.picture(figure, "two bars")
    assert capsys.readouterr().out == "-> two bars\n"
    monkeypatch.setenv(lessons.PICTURES_ENV, "0")
    assert not lessons.rendering()
    monkeypatch.setenv(lessons.PICTURES_ENV, "1")
    assert lessons.rendering()


def test_picture_refuses_a_view_that_draws_nothing():
    class Blank:
        def figures(self):
            return []

    with pytest.raises(ValueError, match="Blank draws no figure"):
        lessons.picture(Blank(), "nothing")
