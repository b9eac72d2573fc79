"""What the teaching notebooks (notebooks/) share, so that their visible cells stay a few lines long:

    from kvscope import lessons
    lessons.say("13 cells are used: one per prompt token.")       # the sentence under an output
    lessons.picture(grid, "After prefill: ...")                    # the same, plus a still for docs/lessons/
    lessons.check(my_answer, expected=13, why="one cell per token")  # an exercise: right, wrong, or reveal

Each notebook's own plumbing (setting up a scenario, the asserts that keep its prose true) lives in a module
of this package named after the lesson, so a reader sees the idea in the notebook and the checks one click
away. The core helpers import neither torch nor the engine.
"""
from kvscope.lessons.core import PICTURES_ENV, check, picture, rendering, say

__all__ = ["PICTURES_ENV", "check", "picture", "rendering", "say"]
