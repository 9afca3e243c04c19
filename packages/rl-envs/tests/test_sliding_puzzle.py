from rl_envs.sliding_puzzle import (
    SlidingPuzzleConfig,
    SlidingPuzzleEnvironment,
    first_prompt,
    new_game,
    parse_moves,
    solved_board,
)


def turn(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_parse_moves():
    assert parse_moves("thinking... <action>up, left</action>") == ["up", "left"]
    assert parse_moves("<action>jump</action>") is None
    assert parse_moves("up left") is None


def test_an_episode_over_several_turns_ends_solved():
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=5))
    state = {"board": [[1, 2, 3], [4, 5, 6], [0, 7, 8]], "turn": 0}
    out = env.step([turn("<action>right</action>")], [state])
    assert out.rewards.tolist() == [0.0] and not out.terminateds[0]
    assert out.metadata[0]["board"] == [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    assert " 7  _  8" in out.observations[0]["content"]
    assert out.next_stop_strings == [["</action>"]]
    out = env.step([turn("<action>right</action>")], out.metadata)
    assert out.rewards.tolist() == [1.0] and out.terminateds[0]
    assert out.metadata[0]["board"] == solved_board(3)
    assert "Solved!" in out.observations[0]["content"]


def test_wrong_and_malformed_actions_use_up_turns_until_the_limit():
    env = SlidingPuzzleEnvironment(SlidingPuzzleConfig(max_turns=2))
    state = {"board": [[1, 2, 3], [4, 0, 5], [7, 8, 6]], "turn": 0}
    out = env.step([turn("<action>left left</action>")], [state])  # the second leaves the board
    assert "Move 2 (left) would leave the board" in out.observations[0]["content"]
    assert out.metadata[0]["board"] == [[1, 2, 3], [0, 4, 5], [7, 8, 6]]
    assert not out.terminateds[0]
    out = env.step([turn("I give up")], out.metadata)
    assert "Invalid action" in out.observations[0]["content"]
    assert out.terminateds[0] and out.rewards.tolist() == [0.0]
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["invalid_actions"] >= 1 and metrics["accuracy"] == 0.0


def test_a_broken_game_state_ends_only_that_episode():
    env = SlidingPuzzleEnvironment()
    good = {"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "turn": 0}
    out = env.step([turn("<action>right</action>")] * 2, [good, {"board": "nonsense"}])
    assert out.rewards.tolist() == [1.0, 0.0]
    assert out.terminateds.tolist() == [True, True]
    _, metrics = env.global_post_process_and_metrics({"rewards": out.rewards})
    assert metrics["verifier_errors"] == 1


def test_first_prompt_shows_the_board_and_the_rules():
    text = first_prompt({"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]], "turn": 0})
    assert text.endswith(" 7  _  8") and "<action>" in text and "8 turns" in text


def test_new_games_are_shuffled_and_reproducible():
    assert new_game(3, 20, seed=5) == new_game(3, 20, seed=5)
    assert new_game(3, 20, seed=5)["board"] != solved_board(3)
