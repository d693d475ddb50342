"""Conversion on hand-built event logs: turn extraction, merge policy, images, rejections.

Token ids are written out by hand around the real image pad runs; the number of pads per image
comes from the transformers image processor (not from the code under test).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cua_rl.errors import ConfigError, RejectedEpisode
from cua_rl.testing.models import TOKEN_ID
from cua_rl.trajectory import (
    TrajectoryConfig,
    convert_events,
    convert_turns,
    events_to_turns,
)

from .conftest import _event, _model_output, _turn_events, png_data_url, solid_png

VS, VE, PAD = TOKEN_ID["<|vision_start|>"], TOKEN_ID["<|vision_end|>"], TOKEN_ID["<|image_pad|>"]
IM_END = TOKEN_ID["<|im_end|>"]


@pytest.fixture(scope="module")
def images(processor):
    """Two screenshots of different sizes and their pad counts per the HF image processor."""
    pngs = [solid_png(360, 640, (200, 30, 30)), solid_png(280, 280, (30, 200, 30))]
    from io import BytesIO

    from PIL import Image

    out = processor.image_processor(
        images=[Image.open(BytesIO(p)).convert("RGB") for p in pngs], return_tensors="pt"
    )
    pads = [int(g[0] * g[1] * g[2]) // 4 for g in out["image_grid_thw"]]
    return [png_data_url(p) for p in pngs], pads, out


def _decode(data_url):
    import base64
    from io import BytesIO

    from PIL import Image

    return Image.open(BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB")


def _img_msg(url, text="look"):
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


def _two_turn_log(images, *, break_prefix=False, logprobs=True):
    urls, pads, _ = images
    p1 = [1, 40, 41, VS] + [PAD] * pads[0] + [VE, 2, 1, 42]
    o1 = [50, 51, IM_END]
    l1 = [-0.5, -1.25, -0.125]
    p2 = p1 + o1 + [43, VS] + [PAD] * pads[1] + [VE, 2, 1, 42]
    if break_prefix:
        p2 = p2.copy()
        p2[len(p1) + 1] = 52  # the history came back re-tokenised differently
    o2 = [60, 61, 62, IM_END]
    l2 = [-0.25, -2.0, -0.75, -0.0625]
    msgs1 = [{"role": "system", "content": "sys"}, _img_msg(urls[0])]
    msgs2 = msgs1 + [{"role": "assistant", "content": "ab"}, _img_msg(urls[1])]
    act = {"name": "tap", "args": {"point": {"x": 1, "y": 2}}, "rawResult": {"ok": True}}
    bad = {"name": "invalid", "args": {"text": "zz"}, "rawResult": {"ok": False}}
    events = _turn_events(1, msgs1, _model_output(p1, o1, l1 if logprobs else None), act)
    events += _turn_events(2, msgs2, _model_output(p2, o2, l2, finish="length"), bad)
    events.append(_event(type="run_end", step=2, ok=False, reason="max_steps"))
    return events, (p1, o1, l1), (p2, o2, l2)


def test_events_to_turns_extracts_everything(images):
    events, (p1, o1, l1), (p2, o2, l2) = _two_turn_log(images)
    events = events + [dict(events[2])]  # a duplicate model_output (re-fetched page)
    parsed = events_to_turns({"events": events})
    assert parsed.duplicates == 1
    assert [t.step for t in parsed.turns] == [1, 2]
    t1, t2 = parsed.turns
    assert (t1.prompt_ids, t1.output_ids, t1.output_logprobs) == (p1, o1, l1)
    assert (t2.prompt_ids, t2.output_ids, t2.output_logprobs) == (p2, o2, l2)
    assert (t1.finish_reason, t2.finish_reason) == ("stop", "length")
    assert t1.image_urls == [images[0][0]]
    assert t2.image_urls == images[0]  # prompt order
    assert t1.action["name"] == "tap" and t1.action_parsed and t1.action_ok
    assert t2.action["name"] == "invalid" and not t2.action_parsed and not t2.action_ok
    assert parsed.run_reason == "max_steps" and parsed.run_ok is False
    assert t1.missing is None


def test_older_turn_field_and_bare_list(images):
    events, *_ = _two_turn_log(images)
    for ev in events:
        ev["turn"] = ev.pop("step")
    parsed = events_to_turns(json.dumps(events))
    assert [t.step for t in parsed.turns] == [1, 2]


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        {"events": "nope"},
        [{"no": "type"}],
        [{"type": "model_call"}],  # no step
        [{"type": "action_executed", "step": 1}],  # no action
        [{"type": "model_output", "step": 1, "modelOutput": {}}],  # output without a call
    ],
)
def test_malformed_events_are_rejected_with_reason(bad):
    with pytest.raises(RejectedEpisode) as exc:
        events_to_turns(bad)
    assert exc.value.reason == "malformed_events"


def test_merged_row_follows_the_contract(images, processor):
    events, (p1, o1, l1), (p2, o2, l2) = _two_turn_log(images)
    res = convert_events(events, processor=processor, reward=0.75, version=7)
    assert res.ok, res.reason
    row = res.row
    L = len(p2) + len(o2)
    assert row["input_ids"].tolist() == [p2 + o2]
    assert row["input_ids"].dtype == torch.long
    mask = [0] * L
    lps = [0.0] * L
    vers = [-1] * L
    for start, out, lp in ((len(p1), o1, l1), (len(p2), o2, l2)):
        for k in range(len(out)):
            mask[start + k], lps[start + k], vers[start + k] = 1, lp[k], 7
    assert row["loss_mask"].tolist() == [mask]
    assert row["logprobs"].tolist() == [lps]
    assert row["versions"].tolist() == [vers]
    assert row["versions"].dtype == torch.int32 and row["logprobs"].dtype == torch.float32
    assert row["attention_mask"].dtype == torch.bool and row["attention_mask"].all()
    assert row["rewards"].tolist() == [0.75] and row["rewards"].shape == (1,)
    assert row["mm_token_type_ids"].tolist() == [[1 if t == PAD else 0 for t in p2 + o2]]
    mm = row["multi_modal_input"]
    _, pads, hf = images
    assert len(mm) == 1
    assert torch.equal(mm[0]["image_grid_thw"], hf["image_grid_thw"])
    assert torch.equal(mm[0]["pixel_values"], hf["pixel_values"])
    assert res.stats["trained_tokens"] == len(o1) + len(o2)
    assert res.stats["images"] == 2 and res.stats["prefix_breaks"] == 0


def test_per_turn_versions(images, processor):
    events, (p1, o1, _), (p2, o2, _) = _two_turn_log(images)
    res = convert_events(events, processor=processor, reward=0.0, version=[3, 4])
    v = res.row["versions"][0].tolist()
    assert v[len(p1) : len(p1) + len(o1)] == [3] * len(o1)
    assert v[len(p2) :] == [4] * len(o2)


def test_prefix_break_gives_each_run_of_calls_its_own_row(images, processor):
    _, pads, hf = images
    events, (p1, o1, l1), (p2, o2, l2) = _two_turn_log(images, break_prefix=True)
    res = convert_events(events, processor=processor, reward=1.0, version=[3, 4], episode_id=77)
    assert res.ok, res.detail
    assert len(res.rows) == 2 and res.trained == {0, 1}
    first, second = res.rows
    assert first["input_ids"][0].tolist() == p1 + o1
    assert first["loss_mask"][0].tolist() == [0] * len(p1) + [1] * len(o1)
    assert first["logprobs"][0, len(p1) :].tolist() == l1
    assert first["versions"][0, len(p1) :].tolist() == [3] * len(o1)
    assert second["input_ids"][0].tolist() == p2 + o2
    assert second["logprobs"][0, len(p2) :].tolist() == l2
    # Each row holds its own prompt's images: the first one screenshot, the second both.
    first_patches = int(hf["image_grid_thw"][0].prod())
    mm1, mm2 = first["multi_modal_input"][0], second["multi_modal_input"][0]
    assert torch.equal(mm1["image_grid_thw"], hf["image_grid_thw"][:1])
    assert torch.allclose(mm1["pixel_values"], hf["pixel_values"][:first_patches])
    assert torch.equal(mm2["image_grid_thw"], hf["image_grid_thw"])
    assert torch.allclose(mm2["pixel_values"], hf["pixel_values"])
    for row in res.rows:
        assert row["rewards"].tolist() == [1.0] and row["episode_id"].tolist() == [77]
    # Every sampled token is trained once; the shared screenshot went through the processor once.
    s = res.stats
    assert s["sampled_tokens"] == s["trained_tokens"] == len(o1) + len(o2)
    assert (s["rows"], s["trained_turns"], s["dropped_turns"]) == (2, 2, 0)
    assert (s["images"], s["distinct_images"], s["processed_images"]) == (3, 2, 2)
    # The batch AReaL receives: both rows, padded to the longer.
    assert res.row["input_ids"].shape == (2, len(p2) + len(o2))
    assert res.row["attention_mask"][0].sum().item() == len(p1) + len(o1)


def test_prefix_break_last_segment_trains_the_tail_and_counts_the_rest(images, processor):
    events, (p1, o1, _), (p2, o2, l2) = _two_turn_log(images, break_prefix=True)
    cfg = TrajectoryConfig(prefix_break_policy="last_segment")
    res = convert_events(events, processor=processor, reward=1.0, version=0, config=cfg)
    assert res.ok
    assert res.stats["prefix_breaks"] == 1 and res.stats["trained_turns"] == 1
    assert res.stats["dropped_turns"] == 1 and res.trained == {1}
    assert res.stats["sampled_tokens"] - res.stats["trained_tokens"] == len(o1)
    assert res.row["input_ids"][0].tolist() == p2 + o2
    assert res.row["loss_mask"][0].tolist() == [0] * len(p2) + [1] * len(o2)
    assert res.row["logprobs"][0, len(p2) :].tolist() == l2


def test_prefix_break_reject(images, processor):
    events, *_ = _two_turn_log(images, break_prefix=True)
    cfg = TrajectoryConfig(prefix_break_policy="reject")
    res = convert_events(events, processor=processor, reward=1.0, version=0, config=cfg)
    assert res.row is None and res.reason == "prefix_break"
    assert res.stats["prefix_breaks"] == 1
    with pytest.raises(RejectedEpisode, match="prefix_break"):
        res.raise_if_rejected()


def test_missing_logprobs_rejected_by_default(images, processor):
    events, *_ = _two_turn_log(images, logprobs=False)
    res = convert_events(events, processor=processor, reward=1.0, version=0)
    assert res.row is None and res.reason == "missing_tokens"
    assert "logprobs" in res.detail


def test_retokenize_refuses_without_trainer_recompute():
    with pytest.raises(ConfigError, match="trainer_recomputes_logprobs"):
        TrajectoryConfig(missing_tokens_policy="retokenize")


def test_retokenize_fallback_when_trainer_recomputes(images, processor):
    urls, _, _ = images
    msgs = [{"role": "system", "content": "sys"}, _img_msg(urls[0], "go")]
    out = {"choices": [{"message": {"content": "tap(1,2)"}, "finish_reason": "stop"}]}
    events = _turn_events(1, msgs, out, {"name": "tap", "args": {}})
    cfg = TrajectoryConfig(missing_tokens_policy="retokenize", trainer_recomputes_logprobs=True)
    res = convert_events(events, processor=processor, reward=1.0, version=2, config=cfg)
    assert res.ok, res.detail
    ids = res.row["input_ids"][0].tolist()
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[_decode(urls[0])], return_tensors="pt")
    n_prompt = enc["input_ids"].shape[1]
    assert ids[:n_prompt] == enc["input_ids"][0].tolist()
    assert processor.tokenizer.decode(ids[-9:]) == "tap(1,2)<|im_end|>"
    assert res.row["loss_mask"][0].sum().item() == 9
    assert res.stats["retokenized_turns"] == 1


def test_image_pad_mismatch_rejected(images, processor):
    events, *_ = _two_turn_log(images)
    # Drop one pad token from the last prompt: the processor needs one more than it holds.
    out = next(e for e in reversed(events) if e["type"] == "model_output")["modelOutput"]
    ids = out["prompt_token_ids"]
    ids.remove(PAD)
    res = convert_events(events, processor=processor, reward=0.0, version=0)
    # The shortened prompt also breaks the prefix; each segment is then checked on its own.
    assert res.stats["prefix_breaks"] == 1
    assert res.reason == "image_pad_mismatch"
    assert "image 0" in res.detail


def test_image_count_mismatch_rejected(images, processor):
    events, *_ = _two_turn_log(images)
    call = next(e for e in reversed(events) if e["type"] == "model_call")
    call["modelSpecificInput"]["messages"].append(_img_msg(images[0][0]))
    res = convert_events(events, processor=processor, reward=0.0, version=0)
    assert res.reason == "image_count_mismatch"


def test_sampled_image_pad_rejected(images, processor):
    events, *_ = _two_turn_log(images)
    out = next(e for e in reversed(events) if e["type"] == "model_output")["modelOutput"]
    out["choices"][0]["token_ids"][1] = PAD
    res = convert_events(events, processor=processor, reward=0.0, version=0)
    assert res.reason == "image_token_in_output"


def test_undecodable_image_rejected(processor):
    msgs = [_img_msg("data:image/png;base64,aGVsbG8=")]
    p = [1, VS, PAD, VE, 2]
    events = _turn_events(1, msgs, _model_output(p, [5, IM_END], [-1.0, -0.5]))
    res = convert_events(events, processor=processor, reward=0.0, version=0)
    assert res.reason == "image_decode_failed"


def test_no_turns_rejected(processor):
    res = convert_events([_event(type="run_end", step=1, ok=False)], processor=processor,
                         reward=0.0, version=0)  # fmt: skip
    assert res.reason == "no_turns"


def test_caller_turns_not_mutated(images, processor):
    events, *_ = _two_turn_log(images)
    parsed = events_to_turns(events)
    before = [list(t.prompt_ids) for t in parsed.turns]
    convert_turns(parsed.turns, processor=processor, reward=0.0, version=0)
    assert [t.prompt_ids for t in parsed.turns] == before


def test_cli_convert(images, tiny_vl_model_dir, tmp_path):
    events, _, (p2, o2, _) = _two_turn_log(images)
    log = tmp_path / "events.json"
    log.write_text(json.dumps({"events": events}))
    out = tmp_path / "row.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "cua_rl.trajectory", "convert", "--events", str(log),
         "--processor", str(tiny_vl_model_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["turns"] == 2
    assert summary["row_len"] == len(p2) + len(o2)
    assert summary["trained_tokens"] == 3 + 4
    assert summary["images"] == 2 and summary["prefix_breaks"] == 0
    assert summary["rejected"] is None
    row = torch.load(out, weights_only=False)
    assert row["input_ids"][0].tolist() == p2 + o2


def test_cli_reports_rejection(images, tiny_vl_model_dir, tmp_path):
    events, *_ = _two_turn_log(images, logprobs=False)
    log = tmp_path / "events.json"
    log.write_text(json.dumps(events))
    proc = subprocess.run(
        [sys.executable, "-m", "cua_rl.trajectory", "convert", "--events", str(log),
         "--processor", str(tiny_vl_model_dir)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1
    assert json.loads(proc.stdout.strip())["rejected"] == "missing_tokens"


def test_turns_carry_their_steps_times():
    # Hand-set timestamps: step 1 from 10:00:00.000 to 10:00:02.500 (ISO, Z), step 2 in epoch ms
    # from 1_700_000_010_000 to 1_700_000_013_250; run_end comes much later and is not a step's.
    out = _model_output([1, 2], [3, IM_END], [-0.5, -0.25])
    msgs = [_img_msg("data:image/png;base64,AAAA")]
    events = [
        _event(type="step_start", step=1, ts="2024-05-01T10:00:00.000Z"),
        _event(type="model_call", step=1, ts="2024-05-01T10:00:00.100Z", messages=msgs),
        _event(type="model_output", step=1, ts="2024-05-01T10:00:01.900Z", modelOutput=out),
        _event(type="step_end", step=1, ts="2024-05-01T10:00:02.500Z"),
        _event(type="step_start", step=2, ts=1_700_000_010_000),
        _event(type="model_call", step=2, ts="1700000010400", messages=msgs),
        _event(type="model_output", step=2, ts=1_700_000_012_000, modelOutput=out),
        _event(type="step_end", step=2, ts=1_700_000_013_250),
        _event(type="run_end", step=2, ts=1_700_000_099_000, ok=True, reason="max_steps"),
    ]
    t1, t2 = events_to_turns(events).turns
    may_first = 1714557600.0  # 2024-05-01T10:00:00Z
    assert (t1.started_at, t1.ended_at) == (may_first, may_first + 2.5)
    assert (t2.started_at, t2.ended_at) == (1_700_000_010.0, 1_700_000_013.25)


def test_turn_times_absent_when_the_log_has_no_readable_ts():
    out = _model_output([1, 2], [3, IM_END], [-0.5, -0.25])
    events = [
        _event(type="model_call", step=1, ts="yesterday", messages=[_img_msg("data:,")]),
        _event(type="model_output", step=1, ts=None, modelOutput=out),
    ]
    (turn,) = events_to_turns(events).turns
    assert (turn.started_at, turn.ended_at) == (None, None)
