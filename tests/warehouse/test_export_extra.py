"""The rollout page's Parquet link from a monitor served without the export's packages (a light
``pip install -e .``): it answered 500 (``No module named 'transformers'``); it now says what is
missing and how to install it (the ``export`` extra), and the page around it still serves."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from cua_rl.monitor.server.app import create_app
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.serving import ThreadedServer

from .conftest import stored
from .test_export import config, record_in

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("missing", ["transformers", "datasets"])
def test_the_parquet_link_names_what_is_missing(
    images, processor, tiny_vl_model_dir, tmp_path, monkeypatch, missing
):
    ep, _ = stored(images, processor, uuid="r-light")
    db = tmp_path / "monitor.db"
    record_in(db, [ep], cfg=config(tiny_vl_model_dir, "full"))
    from cua_rl.monitor import export

    export.decoder.cache_clear()  # a tokenizer another test loaded would hide the import
    monkeypatch.setitem(sys.modules, missing, None)  # as in an environment without it
    store = MonitorStore(db)
    rid = store.read.find_id("rollout", "r-light")
    with ThreadedServer(create_app(store), name="monitor") as server, httpx.Client() as http:
        got = http.get(f"{server.url}/rollouts/{rid}/examples.parquet")
        page = http.get(f"{server.url}/rollouts/{rid}")
    store.close()
    assert got.status_code == 501, got.text
    assert got.text.startswith(f"no export: this monitor's environment lacks {missing}")
    assert "pip install -e '.[export]'" in got.text
    assert page.status_code == 200


def test_the_export_extra_names_both_packages():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in extras["export"]}
    assert names == {"datasets", "transformers"}
