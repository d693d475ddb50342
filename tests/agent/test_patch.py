"""The gbox-mini-agent logprob patch and its apply.sh, on copies of the fixture tree.

The fixture reproduces the described structure of the (non-public) source. Expected file contents
come from the fixture itself (revert must restore it byte for byte) and from the wire format the
issue asks for, never from the patch file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.agent.conftest import APPLY_SH, FIXTURE_TREE

MODEL_FILES = ("src/models/mai-ui.ts", "src/models/qwen3-vl.ts")


def _apply(tree: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(APPLY_SH), *flags, str(tree)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _snapshot(tree: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(tree)): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and "node_modules" not in p.parts and "out" not in p.parts
    }


@pytest.fixture
def checkout(tmp_path) -> Path:
    tree = tmp_path / "gbox-mini-agent"
    shutil.copytree(FIXTURE_TREE, tree)
    return tree


def test_apply_is_idempotent_checkable_and_reverts_byte_for_byte(checkout):
    original = _snapshot(checkout)

    check = _apply(checkout, "--check")
    assert (check.returncode, check.stdout.split(":")[0]) == (1, "not applied")

    first = _apply(checkout)
    assert first.returncode == 0, first.stderr
    patched = _snapshot(checkout)
    for name in MODEL_FILES:
        text = patched[name].decode()
        assert "logprobRequestFields(this.config)" in text
        # The whole response still goes back as modelOutput.
        assert "return { modelSpecificInput, modelOutput, text };" in text
    helper = patched["src/models/logprobs.ts"].decode()
    for wire_field in ("logprobs: true", "return_token_ids: true", "top_logprobs"):
        assert wire_field in helper

    again = _apply(checkout)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert _snapshot(checkout) == patched

    assert _apply(checkout, "--check").returncode == 0

    revert = _apply(checkout, "--revert")
    assert revert.returncode == 0, revert.stderr
    assert _snapshot(checkout) == original

    revert_again = _apply(checkout, "--revert")
    assert revert_again.returncode == 0 and "nothing to revert" in revert_again.stdout
    assert _snapshot(checkout) == original


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        # An upstream change next to the patched line.
        ("src/models/mai-ui.ts", "temperature: 0,", "temperature: 0.2,"),
        # The request is no longer built as `modelSpecificInput`.
        ("src/models/qwen3-vl.ts", "const modelSpecificInput = {", "const request = {"),
    ],
)
def test_apply_refuses_unexpected_code_and_changes_nothing(checkout, path, old, new):
    target = checkout / path
    target.write_text(target.read_text().replace(old, new, 1))
    before = _snapshot(checkout)
    for flags in ((), ("--check",), ("--revert",)):
        res = _apply(checkout, *flags)
        assert res.returncode == 2, (flags, res.stdout, res.stderr)
        assert "does not hold the code this patch expects" in res.stderr
        assert _snapshot(checkout) == before


def test_apply_refuses_a_half_patched_checkout(checkout, tmp_path):
    patched = tmp_path / "patched"
    shutil.copytree(FIXTURE_TREE, patched)
    assert _apply(patched).returncode == 0
    # Only mai-ui.ts (and the helper) patched, qwen3-vl.ts left as it was.
    for name in ("src/models/mai-ui.ts", "src/models/logprobs.ts"):
        (checkout / name).write_bytes((patched / name).read_bytes())
    before = _snapshot(checkout)
    for flags in ((), ("--check",), ("--revert",)):
        res = _apply(checkout, *flags)
        assert res.returncode == 2 and "Nothing was changed" in res.stderr
    assert _snapshot(checkout) == before


def test_apply_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    res = _apply(tmp_path)
    assert res.returncode == 2 and "src/models/mai-ui.ts not found" in res.stderr
    res = _apply(tmp_path / "missing")
    assert res.returncode != 0 and "not a directory" in res.stderr
    res = _apply(tmp_path, "--bogus")
    assert res.returncode == 64 and "unknown option" in res.stderr


@pytest.mark.slow
def test_patched_fixture_compiles_with_tsc(checkout, tsc):
    assert _apply(checkout).returncode == 0
    res = subprocess.run(
        [str(tsc), "-p", "tsconfig.json"], cwd=checkout, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_compiler_catches_a_broken_patch(checkout, tsc):
    """The compile check can fail: a patch that calls the helper wrongly is rejected by tsc."""
    assert _apply(checkout).returncode == 0
    target = checkout / "src/models/mai-ui.ts"
    target.write_text(
        target.read_text().replace(
            "...logprobRequestFields(this.config),", "...logprobRequestFields(this.config, 1),"
        )
    )
    res = subprocess.run(
        [str(tsc), "-p", "tsconfig.json"], cwd=checkout, capture_output=True, text=True, timeout=300
    )
    assert res.returncode != 0 and "mai-ui.ts" in res.stdout


# A stand-in for the openai SDK at run time: the same call shape, backed by fetch, so the
# compiled model classes talk to the real vLLM server.
OPENAI_STUB = """
class OpenAI {
  constructor(options) {
    const base = options.baseURL.replace(/\\/$/, "");
    this.chat = { completions: { create: async (body) => {
      const resp = await fetch(base + "/chat/completions", {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      });
      if (!resp.ok) throw new Error("model answered " + resp.status + ": " + (await resp.text()));
      return await resp.json();
    } } };
  }
}
module.exports = { __esModule: true, default: OpenAI };
"""

RUNNER = """
const { MaiUiModel } = require("./mai-ui.js");
const { Qwen3VlModel } = require("./qwen3-vl.js");
const [baseUrl, name] = process.argv.slice(2);
const messages = [{ role: "user", content: "tap(1, 2)" }];
(async () => {
  const out = {};
  for (const [label, Model, extra] of [
    ["mai_default", MaiUiModel, {}],
    ["mai_top3", MaiUiModel, { topLogprobs: 3 }],
    ["qwen_default", Qwen3VlModel, {}],
    ["qwen_off", Qwen3VlModel, { logprobs: false }],
  ]) {
    const model = new Model({ baseUrl, name, provider: "openai", ...extra });
    const r = await model.call(messages);
    out[label] = { request: r.modelSpecificInput, output: r.modelOutput, text: r.text };
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def _compile_commonjs(checkout: Path, tsc: Path) -> Path:
    out = checkout / "out"
    res = subprocess.run(
        [str(tsc), "-p", "tsconfig.json", "--noEmit", "false", "--outDir", str(out),
         "--module", "commonjs", "--moduleResolution", "node10"],
        cwd=checkout, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (out / "package.json").write_text('{"type": "commonjs"}')
    stub = checkout / "node_modules" / "openai"
    stub.mkdir(parents=True)
    (stub / "index.js").write_text(OPENAI_STUB)
    (stub / "package.json").write_text('{"name": "openai", "main": "index.js"}')
    (out / "run.js").write_text(RUNNER)
    return out


@pytest.mark.slow
def test_patched_model_classes_get_token_ids_and_logprobs_from_vllm(checkout, tsc, vllm_server):
    assert _apply(checkout).returncode == 0
    out = _compile_commonjs(checkout, tsc)
    res = subprocess.run(
        ["node", "run.js", vllm_server.base_url, vllm_server.model],
        cwd=out, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    calls = json.loads(res.stdout)

    for label in ("mai_default", "mai_top3", "qwen_default"):
        req, output = calls[label]["request"], calls[label]["output"]
        assert (req["logprobs"], req["return_token_ids"]) == (True, True), label
        choice = output["choices"][0]
        assert output["prompt_token_ids"] and choice["token_ids"], label
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert calls[label]["text"] == choice["message"]["content"]
    assert "top_logprobs" not in calls["mai_default"]["request"]
    assert calls["mai_top3"]["request"]["top_logprobs"] == 3
    assert all(
        len(c["top_logprobs"]) == 3
        for c in calls["mai_top3"]["output"]["choices"][0]["logprobs"]["content"]
    )
    # The option turns the whole addition off: the request is the unpatched one.
    off = calls["qwen_off"]
    assert not {"logprobs", "return_token_ids", "top_logprobs"} & set(off["request"])
    assert off["output"]["choices"][0].get("logprobs") is None


@pytest.mark.slow
def test_unpatched_model_classes_get_no_token_data(checkout, tsc, vllm_server):
    """The baseline the patch exists for: without it vLLM returns no logprobs or token ids."""
    out = _compile_commonjs(checkout, tsc)
    res = subprocess.run(
        ["node", "run.js", vllm_server.base_url, vllm_server.model],
        cwd=out, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for label, call in json.loads(res.stdout).items():
        assert "logprobs" not in call["request"], label
        choice = call["output"]["choices"][0]
        assert choice.get("logprobs") is None and not choice.get("token_ids"), label
