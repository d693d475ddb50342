"""The gbox-mini-agent logprob patch (apply.sh) on copies of three differently written trees.

The fixture reproduces the described structure of the (non-public) source; the reformatted
fixture and a tree generated here (CRLF, tabs, one-line request, code after an import) hold the
same model classes written differently, so the patch must find the request by its meaning.
Expected contents come from the trees themselves (revert must restore them byte for byte), from
the wire format the issue asks for and from what each tree's author named the model options,
never from the patch's code.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.agent.conftest import APPLY_SH, FIXTURE_TREE, FIXTURE_TREE_REFORMATTED

MODEL_FILES = ("src/models/mai-ui.ts", "src/models/qwen3-vl.ts")
HELPER = "src/models/logprobs.ts"
MARK = "cua-rl logprob patch"

# An awkward layout on purpose: CRLF line ends, tabs, a comment header, two imports on one line,
# a one-line request object and a create call split around its member accesses, with decoy calls
# in a string and a comment, and no newline at the end of the file.
AWKWARD_MAI_UI = "\r\n".join([
    "/* MAI-UI adapter.",
    " * (awkward layout on purpose) */",
    "import OpenAI from 'openai'; import type { Messages, ModelCallResult, ModelConfig } from './types' // two on a line",
    "export class MaiUiModel {",
    "\tprivate openai: OpenAI",
    "\tconstructor(private readonly cfg: ModelConfig) { this.openai = new OpenAI({ baseURL: cfg.baseUrl, apiKey: cfg.apiKey ?? 'EMPTY' }) }",
    "\tasync call(messages: Messages): Promise<ModelCallResult> {",
    '\t\tconst note = "not this one: openai.chat.completions.create({ model })"',
    "\t\t// const old = await this.openai.chat.completions.create({ model: 'x', messages })",
    "\t\tconst modelSpecificInput = { model: (this.cfg.name), messages, temperature: 0, max_tokens: 1024 }",
    "\t\tconst modelOutput = await this.openai . chat",
    "\t\t\t.completions",
    "\t\t\t.create( /* the request */ modelSpecificInput , )",
    "\t\tconst text = modelOutput.choices[0]?.message?.content ?? note.slice(0, 0)",
    "\t\treturn { modelSpecificInput, modelOutput, text }",
    "\t}",
    "}",
])  # fmt: skip
# Code after the last import on its line, a shadowing declaration in an inner block, a `let`
# request whose `{` line ends in a comment and a `model` with a fallback.
AWKWARD_QWEN3_VL = "\r\n".join([
    'import OpenAI from "openai"',
    'import type { Messages, ModelCallResult, ModelConfig } from "./types"; const RETRIES = 0',
    "export class Qwen3VlModel {",
    "\tprivate readonly client: OpenAI",
    "\tprivate readonly settings: ModelConfig",
    "\tconstructor(settings: ModelConfig) {",
    "\t\tthis.settings = settings",
    '\t\tthis.client = new OpenAI({baseURL: settings.baseUrl, apiKey: settings.apiKey ?? "EMPTY"})',
    "\t}",
    "\tasync call(messages: Messages): Promise<ModelCallResult> {",
    '\t\tconst shadow = { model: "decoy", messages }',
    "\t\t{ const modelSpecificInput = shadow; void modelSpecificInput }",
    "\t\tlet modelSpecificInput = { // the request",
    '\t\t\tmodel: this.settings.name || "qwen3-vl", messages,',
    "\t\t\ttemperature: 0.01, top_p: 0.001, max_tokens: 2048 + RETRIES",
    "\t\t}",
    "\t\tconst modelOutput = await this.client.chat.completions.create(modelSpecificInput)",
    '\t\tconst text = modelOutput.choices[0]?.message?.content ?? ""',
    "\t\treturn { modelSpecificInput, modelOutput, text }",
    "\t}",
    "}",
    "",
])  # fmt: skip

# Per tree: the expression its author gave the run's model options in each model class.
MODEL_OPTIONS = {
    "fixture": {"src/models/mai-ui.ts": "this.config", "src/models/qwen3-vl.ts": "this.config"},
    "reformatted": {
        "src/models/mai-ui.ts": "this.modelConfig",
        "src/models/qwen3-vl.ts": "this.#config",
    },
    "awkward": {"src/models/mai-ui.ts": "this.cfg", "src/models/qwen3-vl.ts": "this.settings"},
}
TREES = tuple(MODEL_OPTIONS)


def _apply(
    tree: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # The checkout's own typescript is used unless a test says otherwise.
    base = {k: v for k, v in os.environ.items() if k != "CUA_RL_TYPESCRIPT"}
    return subprocess.run(
        ["bash", str(APPLY_SH), *flags, str(tree)],
        capture_output=True,
        timeout=60,
        text=True,
        env={**base, **(env or {})},
    )


def _snapshot(tree: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(tree)): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and "node_modules" not in p.parts and "out" not in p.parts
    }


def _only_insertions(before: bytes, after: bytes) -> bool:
    ops = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
    return {op for op, *_ in ops} <= {"equal", "insert"}


@pytest.fixture
def make_tree(tmp_path, typescript_pkg):
    """``make_tree(kind)``: a copy of a tree, with typescript in its node_modules as after npm install."""

    def make(kind: str = "fixture", *, name: str | None = None, typescript: bool = True) -> Path:
        tree = tmp_path / (name or kind)
        shutil.copytree(FIXTURE_TREE_REFORMATTED if kind == "reformatted" else FIXTURE_TREE, tree)
        if kind == "awkward":
            (tree / "src/models/mai-ui.ts").write_bytes(AWKWARD_MAI_UI.encode())
            (tree / "src/models/qwen3-vl.ts").write_bytes(AWKWARD_QWEN3_VL.encode())
        if typescript:
            (tree / "node_modules").mkdir()
            (tree / "node_modules" / "typescript").symlink_to(
                typescript_pkg, target_is_directory=True
            )
        return tree

    return make


@pytest.fixture
def checkout(make_tree) -> Path:
    return make_tree("fixture")


@pytest.mark.parametrize("kind", TREES)
def test_apply_is_idempotent_checkable_and_reverts_byte_for_byte(make_tree, kind):
    tree = make_tree(kind)
    original = _snapshot(tree)

    check = _apply(tree, "--check")
    assert (check.returncode, check.stdout.split(":")[0]) == (1, "not applied"), check.stderr

    first = _apply(tree)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("applied:")
    patched = _snapshot(tree)
    assert set(patched) == set(original) | {HELPER}
    for name, options in MODEL_OPTIONS[kind].items():
        # Only additions: every byte of the original is still there, in order.
        assert _only_insertions(original[name], patched[name]), name
        text = patched[name].decode()
        assert text.count(f"...logprobRequestFields({options}),") == 1, (name, text)
        assert text.count("import { logprobRequestFields } from") == 1, name
        # A CRLF file stays CRLF: no bare LF was added.
        if b"\r\n" in original[name]:
            assert patched[name].count(b"\n") == patched[name].count(b"\r\n"), name
    helper = patched[HELPER].decode()
    for wire_field in ("logprobs: true", "return_token_ids: true", "top_logprobs"):
        assert wire_field in helper

    again = _apply(tree)
    assert again.returncode == 0 and "already applied" in again.stdout, again.stderr
    assert _snapshot(tree) == patched

    check = _apply(tree, "--check")
    assert (check.returncode, check.stdout.split(":")[0]) == (0, "applied"), check.stderr

    revert = _apply(tree, "--revert")
    assert revert.returncode == 0 and revert.stdout.startswith("reverted:"), revert.stderr
    assert _snapshot(tree) == original

    revert_again = _apply(tree, "--revert")
    assert revert_again.returncode == 0 and "nothing to revert" in revert_again.stdout
    assert _snapshot(tree) == original


def test_the_reformatted_tree_follows_its_own_style(make_tree):
    """The import uses the file's quotes, semicolons and `.js` extension; tabs stay tabs."""
    tree = make_tree("reformatted")
    assert _apply(tree).returncode == 0
    mai = (tree / "src/models/mai-ui.ts").read_text()
    assert f"import {{ logprobRequestFields }} from './logprobs.js' // {MARK}\n" in mai
    assert f"\n            ...logprobRequestFields(this.modelConfig), // {MARK}\n" in mai

    awkward = make_tree("awkward")
    assert _apply(awkward).returncode == 0
    qwen = (awkward / "src/models/qwen3-vl.ts").read_bytes().decode()
    assert f"\r\n\t\t\t...logprobRequestFields(this.settings), // {MARK}\r\n" in qwen


# Each: a change to the fixture that leaves no request the patch can handle, and what the
# refusal must name.
REFUSED = [
    pytest.param(
        "src/models/qwen3-vl.ts", "this.openai.chat.completions.create(", "this.openai.responses.create(",
        "no `.chat.completions.create(...)` call found", id="no-create-call",
    ),
    pytest.param(
        "src/models/qwen3-vl.ts", "const modelSpecificInput = {", "const request = {",
        "no declaration of `modelSpecificInput`", id="request-not-declared",
    ),
    pytest.param(
        "src/models/mai-ui.ts", "create(modelSpecificInput)", "create(structuredClone(modelSpecificInput))",
        "neither an object literal nor a variable holding one", id="request-from-a-function",
    ),
    pytest.param(
        "src/models/mai-ui.ts", "const modelSpecificInput = {", "const modelSpecificInput = makeRequest() ?? {",
        "with something other than an object literal", id="request-variable-not-a-literal",
    ),
    pytest.param(
        "src/models/mai-ui.ts", "      messages,\n", "      messages,\n      logprobs: false,\n",
        "sets `logprobs` itself", id="request-sets-logprobs",
    ),
    pytest.param(
        "src/models/qwen3-vl.ts", "model: this.config.name,", 'model: "qwen3-vl",',
        "--model-options", id="no-model-options",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("path", "old", "new", "reason"), REFUSED)
def test_apply_refuses_code_it_cannot_patch_and_changes_nothing(checkout, path, old, new, reason):
    target = checkout / path
    assert old in target.read_text()
    target.write_text(target.read_text().replace(old, new, 1))
    before = _snapshot(checkout)
    for flags in ((), ("--check",), ("--revert",)):
        res = _apply(checkout, *flags)
        assert res.returncode == 2, (flags, res.stdout, res.stderr)
        assert f"{path}: " in res.stderr and reason in res.stderr, res.stderr
        assert "Nothing was changed" in res.stderr
        # All or nothing: the other model file was patchable, and it is untouched too.
        assert _snapshot(checkout) == before


def test_model_options_can_be_named_when_the_request_does_not_show_them(checkout):
    target = checkout / "src/models/qwen3-vl.ts"
    target.write_text(target.read_text().replace("model: this.config.name,", 'model: "qwen3-vl",'))
    original = _snapshot(checkout)
    res = _apply(checkout, "--model-options", "this.config")
    assert res.returncode == 0, res.stderr
    assert "...logprobRequestFields(this.config)," in target.read_text()
    # Check, re-apply and revert need no flag: the patched code says what was used.
    assert _apply(checkout, "--check").returncode == 0
    assert "already applied" in _apply(checkout).stdout
    assert _apply(checkout, "--revert").returncode == 0
    assert _snapshot(checkout) == original
    bad = _apply(checkout, "--model-options", "this.config; evil()")
    assert bad.returncode == 64 and "plain property chain" in bad.stderr


def test_apply_refuses_a_half_patched_checkout(checkout, make_tree):
    patched = make_tree("fixture", name="patched")
    assert _apply(patched).returncode == 0
    # Only mai-ui.ts (and the helper) patched, qwen3-vl.ts left as it was.
    for name in ("src/models/mai-ui.ts", HELPER):
        (checkout / name).write_bytes((patched / name).read_bytes())
    before = _snapshot(checkout)
    for flags in ((), ("--check",), ("--revert",)):
        res = _apply(checkout, *flags)
        assert res.returncode == 2 and "Nothing was changed" in res.stderr
        assert "src/models/qwen3-vl.ts: not patched" in res.stderr, res.stderr
    assert _snapshot(checkout) == before


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # A formatter rewrote the marker comment.
        (f", // {MARK}\n", f", //{MARK}\n"),
        # The spread was moved by hand.
        (f"      ...logprobRequestFields(this.config), // {MARK}\n      model: this.config.name,\n",
         f"      model: this.config.name,\n      ...logprobRequestFields(this.config), // {MARK}\n"),
        # The import was removed.
        (f'import {{ logprobRequestFields }} from "./logprobs"; // {MARK}\n', ""),
    ],
)  # fmt: skip
def test_patch_code_edited_after_applying_is_refused(checkout, old, new):
    assert _apply(checkout).returncode == 0
    target = checkout / "src/models/mai-ui.ts"
    assert old in target.read_text()
    target.write_text(target.read_text().replace(old, new, 1))
    before = _snapshot(checkout)
    for flags in ((), ("--check",), ("--revert",)):
        res = _apply(checkout, *flags)
        assert res.returncode == 2, (flags, res.stdout, res.stderr)
        assert "src/models/mai-ui.ts: " in res.stderr and "not what the patch inserts" in res.stderr
    assert _snapshot(checkout) == before


def test_apply_refuses_a_helper_file_it_did_not_write(checkout):
    (checkout / HELPER).write_text("export const logprobs = 1;\n")
    before = _snapshot(checkout)
    res = _apply(checkout)
    assert (
        res.returncode == 2
        and f"{HELPER}: exists and is not the file this patch adds" in res.stderr
    )
    assert _snapshot(checkout) == before


def test_apply_needs_a_typescript_compiler(make_tree, typescript_pkg):
    tree = make_tree("reformatted", typescript=False)
    before = _snapshot(tree)
    res = _apply(tree)
    assert res.returncode == 69 and "npm install" in res.stderr, res.stderr
    assert _snapshot(tree) == before
    res = _apply(tree, env={"CUA_RL_TYPESCRIPT": str(typescript_pkg)})
    assert res.returncode == 0, res.stderr
    res = _apply(tree, env={"CUA_RL_TYPESCRIPT": str(tree / "nowhere")})
    assert res.returncode == 69 and "is not a typescript package" in res.stderr


def test_apply_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    res = _apply(tmp_path)
    assert res.returncode == 2 and "src/models/mai-ui.ts not found" in res.stderr
    res = _apply(tmp_path / "missing")
    assert res.returncode == 66 and "not a directory" in res.stderr
    res = _apply(tmp_path, "--bogus")
    assert res.returncode == 64 and "unknown option" in res.stderr


def _tsc(tree: Path, tsc: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(tsc), "-p", "tsconfig.json"], cwd=tree, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", TREES)
def test_patched_tree_compiles_with_tsc(make_tree, tsc, kind):
    tree = make_tree(kind)
    res = _tsc(tree, tsc)
    assert res.returncode == 0, "unpatched: " + res.stdout + res.stderr
    assert _apply(tree).returncode == 0
    res = _tsc(tree, tsc)
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
    res = _tsc(checkout, tsc)
    assert res.returncode != 0 and "mai-ui.ts" in res.stdout


# A stand-in for the openai SDK at run time: the same call shape, backed by fetch, so the
# compiled model classes talk to the real vLLM server. It sends the request as the model class
# built it, but where ``CAP_MAX_TOKENS`` is set it caps max_tokens there: the tiny random model
# seldom ends an answer, and the classes' 1024 and 2048 tokens cost the two vLLM tests 80 s of a
# CPU server's decoding while the token data under test does not depend on the answer's length
# (the request those tests read is the class's own; the wire test below sets no cap).
OPENAI_STUB = """
class OpenAI {
  constructor(options) {
    const base = options.baseURL.replace(/\\/$/, "");
    this.chat = { completions: { create: async (body) => {
      const cap = Number(process.env.CAP_MAX_TOKENS);
      const sent = cap ? { ...body, max_tokens: Math.min(body.max_tokens ?? cap, cap) } : body;
      const resp = await fetch(base + "/chat/completions", {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(sent),
      });
      if (!resp.ok) throw new Error("model answered " + resp.status + ": " + (await resp.text()));
      return await resp.json();
    } } };
  }
}
module.exports = { __esModule: true, default: OpenAI };
"""

FEW_TOKENS = {"CAP_MAX_TOKENS": "8"}

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
    stub.mkdir(parents=True, exist_ok=True)
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
        cwd=out, capture_output=True, text=True, timeout=120, env={**os.environ, **FEW_TOKENS},
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
        cwd=out, capture_output=True, text=True, timeout=120, env={**os.environ, **FEW_TOKENS},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for label, call in json.loads(res.stdout).items():
        assert "logprobs" not in call["request"], label
        choice = call["output"]["choices"][0]
        assert choice.get("logprobs") is None and not choice.get("token_ids"), label


@pytest.fixture
def recording_model_server():
    """A loopback stand-in for the model server that records each request body and answers a
    fixed completion: the wire view of what the compiled model classes send."""
    bodies: list[dict] = []
    answer = json.dumps({
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "tap(1, 2)"}}],
    }).encode()  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("reformatted", "awkward"))
def test_patched_model_classes_send_the_fields_whatever_the_layout(
    make_tree, tsc, recording_model_server, kind
):
    base_url, bodies = recording_model_server
    tree = make_tree(kind)
    assert _apply(tree).returncode == 0
    out = _compile_commonjs(tree, tsc)
    res = subprocess.run(
        ["node", "run.js", base_url, "tiny"], cwd=out, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    # RUNNER's calls, in order: mai default, mai with topLogprobs 3, qwen default, qwen off.
    mai, mai_top3, qwen, qwen_off = bodies
    for body in (mai, mai_top3, qwen):
        assert (body["logprobs"], body["return_token_ids"]) == (True, True), body
        assert body["model"] == "tiny"
    assert "top_logprobs" not in mai and mai_top3["top_logprobs"] == 3
    # The request keeps what the model class set itself.
    assert (mai["temperature"], mai["max_tokens"]) == (0, 1024)
    assert (qwen["temperature"], qwen["top_p"], qwen["max_tokens"]) == (0.01, 0.001, 2048)
    assert not {"logprobs", "return_token_ids", "top_logprobs"} & set(qwen_off)
    assert qwen_off["max_tokens"] == 2048
