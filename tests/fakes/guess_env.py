"""Toy environments a person might write (trainer/episode/interface.py), for the tests: a
number-guessing game over the list-sum task, and ones that break the interface in each way.

GuessEnv: the secret is the problem's answer (the list's sum). The model's guess is the number
after the last '>' of its turn (the built-in model writes "2+3=5;>5"). A wrong guess gets "higher"
or "lower" and another turn; a right one ends the episode. The reward is 1 for a right first
guess, LATE_CREDIT for a right guess after hints, GUESS_CREDIT for an episode that guessed
wrong (values the sum task's verifier never gives: the tests see that the environment's score was
used), 0 for one that never guessed. The guesses are kept in the
episode's state."""
from __future__ import annotations

import re

from trainer.episode.interface import done, feedback

LATE_CREDIT, GUESS_CREDIT = 0.5, 0.125


def last_guess(turn: str) -> int | None:
    found = re.findall(r">\s*(-?\d+)", turn)
    return int(found[-1]) if found else None


class GuessEnv:
    def start(self, problem) -> dict:
        return {"secret": int(problem.answer), "guesses": []}

    def respond(self, turn: str, episode: dict):
        state = episode["state"]
        guess = last_guess(turn)
        state["guesses"].append(guess)
        if guess is None or guess == state["secret"]:
            return done()
        return feedback("higher" if guess < state["secret"] else "lower")

    def score(self, turn: str, episode: dict) -> float:
        state, guess = episode["state"], last_guess(turn)
        if guess != state["secret"]:
            guessed = guess is not None or any(g is not None for g in state["guesses"])
            return GUESS_CREDIT if guessed else 0.0
        return 1.0 if episode["turns"] == 1 else LATE_CREDIT


class FailingEnv(GuessEnv):
    """Raises in respond on every other episode's turn (by the secret's parity)."""

    def respond(self, turn: str, episode: dict):
        if episode["state"]["secret"] % 2:
            raise RuntimeError("the game server is down")
        return super().respond(turn, episode)


class NoScore:
    def start(self, problem):
        return None

    def respond(self, turn, episode):
        return done()


class BrokenInit(GuessEnv):
    def __init__(self):
        raise RuntimeError("no game server configured")


not_a_class = GuessEnv()
