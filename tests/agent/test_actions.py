"""The action language: parsing, translation to events / gym calls, and the decoding regex."""

from __future__ import annotations

import re

import pytest

from cua_rl.agent.actions import (
    ACTION_NAMES,
    REGEX_MAX_CHARS,
    ActionParseError,
    action_regex,
    int_range_regex,
    parse_action,
    to_event_args,
    to_gym_action,
)

CASES = [
    ("tap(12, 34)", "tap", {"point": {"x": 12, "y": 34}}, {"name": "tap", "args": {"x": 12, "y": 34}}),
    ("I see wifi. swipe(1,2, 3 ,4) then", "swipe",
     {"startPoint": {"x": 1, "y": 2}, "endPoint": {"x": 3, "y": 4}},
     {"name": "swipe", "args": {"x1": 1, "y1": 2, "x2": 3, "y2": 4}}),
    ('type("hi \\"you\\"")', "type", {"content": 'hi "you"'}, {"name": "type", "args": {"text": 'hi "you"'}}),
    ("key(Enter)", "key", {"key": "enter"}, {"name": "key", "args": {"key": "enter"}}),
    ("back()", "back", {}, {"name": "back", "args": {}}),
    ("home( )", "home", {}, {"name": "home", "args": {}}),
    ("wait(2)", "wait", {"durationMs": 2000}, {"name": "wait", "args": {"seconds": 2.0}}),
    ('finished("wifi is on")', "finished", {"content": "wifi is on"}, None),
    ("back() tap(1, 1)", "back", {}, {"name": "back", "args": {}}),  # the first call wins
]  # fmt: skip


@pytest.mark.parametrize(("text", "name", "event_args", "gym_action"), CASES)
def test_parse_translates_to_event_args_and_gym_action(text, name, event_args, gym_action):
    action = parse_action(text)
    assert action.name == name
    assert to_event_args(action) == event_args
    assert to_gym_action(action) == gym_action


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "click(1, 2)",
        "retap(1, 2)",
        "tap(1)",
        "key(f13)",
        'type("unterminated)',
        "nothing",
    ],
)
def test_parse_rejects_outputs_without_a_valid_call(text):
    with pytest.raises(ActionParseError):
        parse_action(text)


@pytest.mark.parametrize("upper", [1, 2, 9, 10, 11, 57, 100, 101, 360, 640, 1000])
def test_int_range_regex_matches_exactly_zero_to_upper_minus_one(upper):
    pattern = re.compile(int_range_regex(upper))
    matched = {n for n in range(0, 3 * upper + 20) if pattern.fullmatch(str(n))}
    assert matched == set(range(upper))
    assert not pattern.fullmatch("00") and not pattern.fullmatch("-1")


def test_action_regex_accepts_on_screen_calls_that_parse():
    regex = re.compile(action_regex(width=360, height=640))
    for text in ["tap(0, 639)", "tap(359,0)", "swipe(10, 20, 30, 40)", 'type("abc def")',
                 "key(backspace)", "back()", "home()", "wait(3)", 'finished("done")']:  # fmt: skip
        assert regex.fullmatch(text), text
        assert parse_action(text).text == text
        assert len(text) <= REGEX_MAX_CHARS
    for text in ["tap(360, 5)", "tap(5, 640)", "tap(05, 5)", "wait(9)", 'type("ABC")', "key(f1)"]:
        assert not regex.fullmatch(text), text


def test_action_regex_restricts_names():
    regex = re.compile(action_regex(["tap", "back"], 100, 100))
    assert regex.fullmatch("back()") and regex.fullmatch("tap(1, 2)")
    assert not regex.fullmatch("home()") and not regex.fullmatch('finished("x")')
    with pytest.raises(ValueError, match="unknown action names"):
        action_regex(["tap", "click"])
    assert set(ACTION_NAMES) >= {"tap", "finished"}


def test_lenient_reading_turns_any_reply_into_a_grid_tap():
    from cua_rl.agent.actions import grid_cell_centre, read_reply

    # A valid call is taken as written.
    assert read_reply("tap(3, 4)", 360, 640, lenient=True).params == {"x": 3, "y": 4}
    # Anything else taps the centre of the cell its first character names (code point mod 9).
    action = read_reply("  zq!", 360, 640, lenient=True)
    cell = ord("z") % 9
    assert action.name == "tap"
    assert (action.params["x"], action.params["y"]) == grid_cell_centre(cell, 360, 640)
    assert grid_cell_centre(2, 360, 640) == (300, 106)  # top-right
    assert grid_cell_centre(4, 360, 640) == (180, 320)  # centre
    with pytest.raises(ActionParseError):
        read_reply("zq!", 360, 640)  # strict by default
    with pytest.raises(ActionParseError):
        read_reply("   ", 360, 640, lenient=True)  # an empty reply is no action
