"""The shared image decoding: one error type and reason for every caller, sizes refused before
decoding, the same types sniffed for the monitor and the converter."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from cua_rl.core.images import (
    ImageRefused,
    check_image_url,
    decode_data_url,
    image_bytes,
    sniff_mime,
)
from cua_rl.errors import RejectedEpisode
from cua_rl.monitor.protocol import ScreenshotError
from cua_rl.monitor.worker import uploader
from cua_rl.trajectory import TrajectoryConfig


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_a_data_url_decodes_to_its_bytes_and_the_type_is_sniffed():
    png = _png()
    assert decode_data_url(_url(png)) == png
    assert sniff_mime(png) == "image/png"
    assert sniff_mime(b"\xff\xd8\xff\xe0" + b"x" * 8) == "image/jpeg"
    assert sniff_mime(b"RIFF\0\0\0\0WEBPVP8 ") == "image/webp"
    assert sniff_mime(b"<html>") is None and sniff_mime(b"GIF89a" + b"x" * 8) is None
    assert sniff_mime(b"GIF89a" + b"x" * 8, gif=True) == "image/gif"  # the gateway's types


@pytest.mark.parametrize(
    ("url", "reason", "words"),
    [
        ("data:text/plain;base64,AAAA", "image_decode_failed", "not an image data URL"),
        ("data:image/png,rawbytes", "image_decode_failed", "only base64"),
        ("data:image/png;base64,@@@@", "image_decode_failed", "bad base64"),
        ("no comma at all", "image_decode_failed", "not an image data URL"),
    ],
)
def test_bad_data_urls_are_refused_with_a_reason(url, reason, words):
    with pytest.raises(ImageRefused, match=words) as err:
        decode_data_url(url)
    assert err.value.reason == reason and isinstance(err.value, RejectedEpisode | ValueError)


def test_an_oversize_payload_is_refused_before_decoding():
    url = "data:image/png;base64," + "@" * 400  # not even base64: size is checked first
    with pytest.raises(ImageRefused) as err:
        decode_data_url(url, max_bytes=100)
    assert err.value.reason == "image_too_large" and "~300 bytes > 100" in str(err.value)
    assert decode_data_url(_url(_png()), max_bytes=10_000)


def test_the_trajectory_and_the_monitor_decode_alike():
    png = _png()
    config = TrajectoryConfig(max_image_bytes=10)
    with pytest.raises(ImageRefused, match="image_too_large"):
        image_bytes(_url(png), {}, config)  # the row builder's read of a screenshot
    assert uploader.decode_data_url(_url(png)) == decode_data_url(_url(png)) == png
    assert uploader.sniff_mime(png) == sniff_mime(png) == "image/png"
    for bad in ("data:text/plain;base64,AAAA", "data:image/png;base64,@@@"):
        with pytest.raises(ScreenshotError) as err:
            uploader.decode_data_url(bad)
        assert err.value.code == "not_an_image"
        with pytest.raises(ValueError):
            decode_data_url(bad)


def test_the_url_policy():
    config = TrajectoryConfig(allowed_image_hosts=("shots.example.com",))
    assert check_image_url("data:image/png;base64,AAAA", config) == "data"
    assert check_image_url("https://Shots.example.com/a.png", config) == "http"
    for url, words in (
        ("http://shots.example.com/a.png", "scheme 'http' not allowed"),
        ("https://elsewhere.example.com/a.png", "not in allowed_image_hosts"),
        ("file:///etc/passwd", "scheme 'file'"),
    ):
        with pytest.raises(ImageRefused, match=words) as err:
            check_image_url(url, config)
        assert err.value.reason == "image_url_refused"
    allow_http = TrajectoryConfig(allowed_image_hosts=("shots.example.com",), allow_http=True)
    assert check_image_url("http://shots.example.com/a.png", allow_http) == "http"
