"""State keys on real screenshots of the local gym, over HTTP, with the phone's clock ticking.

The gym's phone moves its status-bar clock a minute per action (``clock: ticking``), as a real
phone's does between screenshots: the same screen then never repeats byte for byte. What must
hold: the perceptual hash (status bar masked) groups a screen with itself under a changed
clock; it does not group different screens; the strict key (the bytes) splits them; the gym's own
keys name states, not pictures, so a screen reached again by another path has the same key.
"""

from __future__ import annotations

import base64
import hashlib

import httpx
import pytest

from cua_rl.credit.config import StateKeyConfig
from cua_rl.credit.keys import Clusters, StateKey, distance, exact_of, phash_of, same_state
from cua_rl.sim.gym import GymServer, SimGymConfig

NOTHING = (60, 533)  # bottom-left cell's centre: empty on Settings and on setup page 1
WIFI = (300, 106)  # the Wi-Fi switch on Settings
NEXT, BACK = (180, 320), (180, 106)  # the setup wizard's middle and top bands


@pytest.fixture(scope="module")
def gym():
    with GymServer(SimGymConfig(clock="ticking")) as server:
        yield server


class Box:
    """One execution of the gym, driven over HTTP."""

    def __init__(self, gym: GymServer, task_id: str):
        self.base = gym.base_url
        r = httpx.post(f"{self.base}/tasks/{task_id}", json={})
        assert r.status_code == 200, r.text
        self.id = r.json()["execution_id"]

    def screenshot(self) -> bytes:
        r = httpx.post(f"{self.base}/executions/{self.id}/screenshot")
        assert r.status_code == 200, r.text
        return base64.b64decode(r.json()["data_url"].split(",", 1)[1])

    def tap(self, xy: tuple[int, int]) -> dict:
        r = httpx.post(
            f"{self.base}/executions/{self.id}/actions",
            json={"name": "tap", "args": {"x": xy[0], "y": xy[1]}},
        )
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        httpx.post(f"{self.base}/executions/{self.id}/terminate", json={})


def exact(data: bytes) -> StateKey:
    return exact_of(hashlib.sha256(data).hexdigest())


def test_the_same_screen_under_a_changed_clock_is_one_state_and_others_are_not(gym):
    box = Box(gym, "sim-016-learn-wifi-off")  # Settings, Wi-Fi on
    try:
        before = box.screenshot()
        for _ in range(7):  # nothing there: only the clock moves (12:00 -> 12:07)
            answer = box.tap(NOTHING)
            assert answer["state_key_before"] == answer["state_key_after"]
        later = box.screenshot()
        flipped = box.tap(WIFI)
        assert flipped["state_key_before"] != flipped["state_key_after"]
        off = box.screenshot()
    finally:
        box.close()
    assert before != later  # the clock changed pixels of the status bar
    cfg = StateKeyConfig()  # phash, status bar masked, threshold 4 of 64 bits
    assert same_state(phash_of(before, cfg), phash_of(later, cfg), cfg)
    assert not same_state(exact(before), exact(later), cfg)  # the strict mode splits them
    assert not same_state(phash_of(later, cfg), phash_of(off, cfg), cfg)  # Wi-Fi off: another
    assert distance(phash_of(later, cfg), phash_of(off, cfg)) > 2 * cfg.threshold
    # With no tolerance the mask is what groups them: unmasked, the clock moves the hash.
    strict = StateKeyConfig(threshold=0)
    bare = StateKeyConfig(threshold=0, mask=[])
    assert same_state(phash_of(before, strict), phash_of(later, strict), strict)
    assert not same_state(phash_of(before, bare), phash_of(later, bare), bare)


def test_different_screens_of_the_wizard_are_different_states(gym):
    box = Box(gym, "sim-021-learn-long-setup-trap2")
    try:
        page1 = box.screenshot()
        box.tap(NEXT)
        page2 = box.screenshot()  # the trap page: an Erase band
        box.tap(NOTHING)  # erase
        erased = box.screenshot()
    finally:
        box.close()
    cfg = StateKeyConfig()
    keys = [phash_of(shot, cfg) for shot in (page1, page2, erased)]
    clusters = Clusters(cfg)
    assert [clusters.assign(k) for k in keys] == [0, 1, 2]


def test_the_gym_names_a_state_reached_again_by_another_path_alike(gym):
    # One execution goes Next then Back (a detour): it is on page 1 again, with the clock two
    # minutes on; another starts there. The gym's keys agree, the screenshots' bytes do not.
    detour, fresh = (
        Box(gym, "sim-022-learn-long-setup-trap3"),
        Box(gym, "sim-022-learn-long-setup-trap3"),
    )
    try:
        start = fresh.screenshot()
        first = fresh.tap(NOTHING)  # page 1's bottom band: nothing
        on = detour.tap(NEXT)
        back = detour.tap(BACK)
        again = detour.screenshot()
    finally:
        detour.close()
        fresh.close()
    assert back["state_key_after"] == on["state_key_before"] == first["state_key_before"]
    assert on["state_key_after"] != on["state_key_before"]
    cfg = StateKeyConfig()
    assert start != again
    assert same_state(phash_of(start, cfg), phash_of(again, cfg), cfg)
