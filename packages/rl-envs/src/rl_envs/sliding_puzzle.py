"""A multi-turn game: the model slides tiles of an n x n puzzle until it is solved.

Each turn the model answers with moves of the blank in an ``<action>`` tag, e.g.
``<action>up left</action>``; the environment applies them and replies with the new board. The
episode ends with reward 1 when the board is solved, or with reward 0 at the turn limit. The
game state travels in the metadata (``{"board": [[1, 2, 3], [4, 0, 5], ...], "turn": 0}``, 0 is
the blank), so the environment itself stays stateless and any actor can take any episode.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

import torch

from rl_data.types import MessageLog
from rl_distributed.config import ConfigModel
from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn, last_assistant_text
from rl_envs.metrics import OutcomeCounts, reward_metrics

Board = list[list[int]]
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)


class SlidingPuzzleConfig(ConfigModel):
    # Turns before an unsolved episode ends.
    max_turns: int = 8
    # Most moves one response may make; more is an invalid action.
    max_moves_per_turn: int = 32


def solved_board(size: int) -> Board:
    tiles = [*range(1, size * size), 0]
    return [tiles[r * size : (r + 1) * size] for r in range(size)]


def _blank(board: Board) -> tuple[int, int]:
    return next((r, c) for r, row in enumerate(board) for c, v in enumerate(row) if v == 0)


def apply_move(board: Board, move: str) -> Board | None:
    """The board after moving the blank one step, or None when that leaves the board."""
    dr, dc = MOVES[move]
    r, c = _blank(board)
    nr, nc = r + dr, c + dc
    if not (0 <= nr < len(board) and 0 <= nc < len(board)):
        return None
    new = [row[:] for row in board]
    new[r][c], new[nr][nc] = new[nr][nc], 0
    return new


def new_game(size: int = 3, shuffle_moves: int = 10, seed: int = 0) -> dict[str, Any]:
    """Metadata for a fresh episode: a solvable board, ``shuffle_moves`` random moves from solved."""
    rng = random.Random(seed)
    board = solved_board(size)
    while board == solved_board(size):
        for _ in range(shuffle_moves):
            board = apply_move(board, rng.choice(list(MOVES))) or board
    return {"board": board, "turn": 0}


def render(board: Board) -> str:
    return "\n".join(" ".join(f"{v:2d}" if v else " _" for v in row) for row in board)


def first_prompt(state: Mapping[str, Any], cfg: SlidingPuzzleConfig | None = None) -> str:
    """The opening user message for an episode starting at ``state``."""
    cfg = cfg or SlidingPuzzleConfig()
    size = len(state["board"])
    return (
        f"Solve this {size}x{size} sliding puzzle: order the tiles 1 to {size * size - 1} row "
        f"by row with the blank (_) last. Move the blank with <action>...</action> holding up to "
        f"{cfg.max_moves_per_turn} of up, down, left, right; you have {cfg.max_turns} turns.\n"
        f"{render(state['board'])}"
    )


def parse_moves(response: str) -> list[str] | None:
    """Moves in the last ``<action>`` tag; None when there is no tag or a word is not a move."""
    tags = _ACTION.findall(response)
    if not tags:
        return None
    moves = re.split(r"[\s,]+", tags[-1].strip().lower())
    return moves if moves and all(m in MOVES for m in moves) else None


class SlidingPuzzleEnvironment(EnvironmentInterface):
    def __init__(self, cfg: SlidingPuzzleConfig | None = None) -> None:
        self.cfg = cfg or SlidingPuzzleConfig()
        self.counts = OutcomeCounts()
        self.invalid_actions = 0

    def _play(
        self, response: str, state: Mapping[str, Any]
    ) -> tuple[str, dict[str, Any], float, bool, str | None]:
        board: Board = [list(map(int, row)) for row in state["board"]]
        if any(len(row) != len(board) for row in board):
            raise ValueError(f"board is not square: {board}")
        turn = int(state["turn"]) + 1
        moves = parse_moves(response)
        note = ""
        if moves is None or len(moves) > self.cfg.max_moves_per_turn:
            self.invalid_actions += 1
            note = f"Invalid action: answer with <action>moves</action>, moves from {sorted(MOVES)} (at most {self.cfg.max_moves_per_turn}).\n"
        else:
            for i, move in enumerate(moves):
                after = apply_move(board, move)
                if after is None:
                    # Moves up to the illegal one stand: the model sees where it went wrong.
                    self.invalid_actions += 1
                    note = f"Move {i + 1} ({move}) would leave the board; the moves before it were made.\n"
                    break
                board = after
        solved = board == solved_board(len(board))
        done = solved or turn >= self.cfg.max_turns
        status = (
            "Solved!"
            if solved
            else ("Out of turns." if done else f"Turn {turn} of {self.cfg.max_turns}.")
        )
        answer = " ".join(moves) if moves else None
        return (
            f"{note}{render(board)}\n{status}",
            {"board": board, "turn": turn},
            float(solved),
            done,
            answer,
        )

    def step(
        self, message_log_batch: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        observations, new_meta, rewards, dones, answers = [], [], [], [], []
        for log, state in zip(message_log_batch, metadata, strict=True):
            try:
                text, meta, reward, done, answer = self._play(last_assistant_text(log), state)
                self.counts.add("ok")
            except Exception as e:  # a broken game state ends that episode, not the run
                text, meta, reward, done, answer = f"Game error: {e}", state, 0.0, True, None
                self.counts.add("error")
            observations.append({"role": "environment", "content": text})
            new_meta.append(meta)
            rewards.append(reward)
            dones.append(done)
            answers.append(answer)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_meta,
            next_stop_strings=[["</action>"]] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(dones, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], dict[str, float]]:
        metrics = {**reward_metrics(batch["rewards"], batch.get("group_ids")), **self.counts.take()}
        metrics["invalid_actions"], self.invalid_actions = float(self.invalid_actions), 0
        return batch, metrics
