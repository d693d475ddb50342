#!/usr/bin/env node
// cua-rl's logprob patch for gbox-mini-agent, found by meaning rather than by lines.
//
// The TypeScript compiler parses src/models/mai-ui.ts and src/models/qwen3-vl.ts; in each, every
// `<client>.chat.completions.create(...)` call is found and its request object (the object
// literal passed to it, or the one the variable passed to it was declared with) gets one spread,
// `...logprobRequestFields(<model options>)`, as its first property; an import of that function
// from the new src/models/logprobs.ts follows the file's last import. The model options are the
// object whose `.name` the request sends as `model` (the run's `model` object). First, because a
// first property is valid whatever the object's commas; a request that sets the fields itself
// (which would then win) is refused instead.
//
// Every insertion carries the marker comment "cua-rl logprob patch" and has one of a few fixed
// shapes, so `--revert` removes exactly the bytes that were inserted. A file counts as patched
// only if removing the marked code and patching again gives back the same bytes; anything else
// (half-patched, edited after patching) is refused. All files are planned and checked in memory
// first, then written together, so a tree is patched completely or not at all.
//
// Run through apply.sh; `node patch.cjs --help` prints the usage and exit codes.
"use strict";

const fs = require("fs");
const path = require("path");

const USAGE = `usage: apply.sh [--check | --revert] [--model-options EXPR] [CHECKOUT]
  (CHECKOUT defaults to the current directory)

  (no flag)   apply; a checkout that already has the patch is left as it is
  --check     say whether the patch is applied
  --revert    remove the patch, restoring the files byte for byte
  --model-options EXPR
              the expression, inside the model classes, of the run's model options object
              (e.g. this.config); default: X where the request has \`model: X.name\`

exit codes:
  0   done (applied, already applied, reverted, nothing to revert; --check: applied)
  1   --check only: not applied, and it can be applied
  2   refused, nothing changed: the code is not what the patch can handle (no create call,
      request not an object literal, half-patched or edited patch code); the message names
      the file and what was not found
  64  bad usage
  66  CHECKOUT is not a directory
  69  node or the TypeScript compiler is not available`;

const EXIT = { ok: 0, notApplied: 1, refused: 2, usage: 64, noInput: 66, unavailable: 69 };
const MARK = "cua-rl logprob patch";
const FN = "logprobRequestFields";
const HELPER = "src/models/logprobs.ts";
const MODEL_FILES = ["src/models/mai-ui.ts", "src/models/qwen3-vl.ts"];
const HELPER_TEMPLATE = path.join(__dirname, "logprobs.ts");
// Keys the helper sets: a request that sets one itself would silently win over the patch.
const OWN_KEYS = ["logprobs", "top_logprobs", "return_token_ids"];

// A model-options expression: `this` or an identifier, then plain property accesses.
const CHAIN = String.raw`(?:this|[A-Za-z_$][\w$]*)(?:\??\.#?[A-Za-z_$][\w$]*)*`;
const CHAIN_RE = new RegExp(`^${CHAIN}$`);
// The shapes apply inserts, and only those, are what revert removes.
const IMPORT_RE = new RegExp(
  String.raw`^import \{ ${FN} \} from (["'])\./logprobs(?:\.js|\.ts)?\1;? // ${MARK}\r?\n`,
  "gm",
);
const LINE_SPREAD_RE = new RegExp(
  String.raw`^[ \t]*\.\.\.${FN}\((${CHAIN})\), // ${MARK}\r?\n`,
  "gm",
);
const INLINE_SPREAD_RE = new RegExp(String.raw` \.\.\.${FN}\((${CHAIN})\), /\* ${MARK} \*/`, "g");

class Refusal extends Error {}

// A closed stdout (`apply.sh | head -1`) must not turn a finished run into a crash report.
process.stdout.on("error", (err) => {
  if (err.code !== "EPIPE") throw err;
});

function fail(code, message) {
  process.stderr.write(`apply.sh: ${message}\n`);
  process.exit(code);
}

function parseArgs(argv) {
  const opts = { mode: "apply", target: ".", modelOptions: null };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--check") opts.mode = "check";
    else if (arg === "--revert") opts.mode = "revert";
    else if (arg === "-h" || arg === "--help") {
      process.stdout.write(USAGE + "\n");
      process.exit(EXIT.ok);
    } else if (arg === "--model-options") {
      opts.modelOptions = argv[++i];
      if (!opts.modelOptions || !CHAIN_RE.test(opts.modelOptions)) {
        fail(
          EXIT.usage,
          `--model-options needs a plain property chain such as this.config, got ${JSON.stringify(opts.modelOptions ?? "")}\n${USAGE}`,
        );
      }
    } else if (arg.startsWith("-")) fail(EXIT.usage, `unknown option ${arg}\n${USAGE}`);
    else opts.target = arg;
  }
  return opts;
}

function loadTypeScript(target) {
  // The checkout's own compiler (what its `tsc` would use); CUA_RL_TYPESCRIPT overrides it.
  const explicit = process.env.CUA_RL_TYPESCRIPT;
  let where;
  try {
    where = explicit
      ? require.resolve(path.resolve(explicit))
      : require.resolve("typescript", { paths: [target] });
  } catch (err) {
    fail(
      EXIT.unavailable,
      explicit
        ? `CUA_RL_TYPESCRIPT=${explicit} is not a typescript package (${err.code || err.message})`
        : `the TypeScript compiler is needed to find the model call, and none is installed in ${target}: ` +
            "run `npm install` there, or set CUA_RL_TYPESCRIPT to a typescript package directory",
    );
  }
  const ts = require(where);
  if (typeof ts.createSourceFile !== "function" || Number(String(ts.version).split(".")[0]) < 4) {
    fail(EXIT.unavailable, `${where} is not a TypeScript compiler of version 4 or later`);
  }
  return ts;
}

// ---- reading the code -------------------------------------------------------------------------

function unwrap(ts, node) {
  for (;;) {
    if (
      ts.isParenthesizedExpression(node) ||
      ts.isNonNullExpression(node) ||
      ts.isAsExpression(node)
    )
      node = node.expression;
    else if (ts.isTypeAssertionExpression && ts.isTypeAssertionExpression(node))
      node = node.expression;
    else if (ts.isSatisfiesExpression && ts.isSatisfiesExpression(node)) node = node.expression;
    else return node;
  }
}

function isCreateCall(ts, node) {
  if (!ts.isCallExpression(node)) return false;
  const names = ["create", "completions", "chat"];
  let callee = unwrap(ts, node.expression);
  for (const name of names) {
    if (!ts.isPropertyAccessExpression(callee) || callee.name.text !== name) return false;
    callee = unwrap(ts, callee.expression);
  }
  return true;
}

// `this.config`, `cfg`, `this.opts?.model`: rebuilt from the tree, so comments and line breaks
// inside the original expression do not end up in the inserted code.
function chainText(ts, node) {
  node = unwrap(ts, node);
  if (node.kind === ts.SyntaxKind.ThisKeyword) return "this";
  if (ts.isIdentifier(node)) return node.text;
  if (ts.isPropertyAccessExpression(node)) {
    const base = chainText(ts, node.expression);
    if (base === null) return null;
    return base + (node.questionDotToken ? "?." : ".") + node.name.text;
  }
  return null;
}

function propertyName(ts, prop) {
  const name = prop.name;
  if (!name) return null;
  if (ts.isIdentifier(name) || ts.isStringLiteral(name) || ts.isNoSubstitutionTemplateLiteral(name))
    return name.text;
  return null;
}

function lineOf(sf, pos) {
  return sf.getLineAndCharacterOfPosition(pos).line + 1;
}

// The declaration of `id` visible at `id`: the nearest enclosing block, function or file that
// declares it (a parameter counts, and means the request comes from outside).
function findDeclaration(ts, id) {
  const name = id.text;
  for (let scope = id.parent; scope; scope = scope.parent) {
    if (ts.isFunctionLike(scope) && scope.parameters) {
      const param = scope.parameters.find((p) => ts.isIdentifier(p.name) && p.name.text === name);
      if (param) return { param };
    }
    if (!scope.statements) continue; // blocks, case clauses, the file
    for (const st of scope.statements) {
      if (!ts.isVariableStatement(st)) continue;
      for (const decl of st.declarationList.declarations) {
        if (ts.isIdentifier(decl.name) && decl.name.text === name)
          return { decl, list: st.declarationList, scope };
      }
    }
  }
  return null;
}

function isReassigned(ts, scope, name) {
  let found = false;
  const visit = (node) => {
    if (found) return;
    if (
      ts.isBinaryExpression(node) &&
      node.operatorToken.kind === ts.SyntaxKind.EqualsToken &&
      ts.isIdentifier(unwrap(ts, node.left)) &&
      unwrap(ts, node.left).text === name
    ) {
      found = true;
      return;
    }
    ts.forEachChild(node, visit);
  };
  visit(scope);
  return found;
}

// The object literal a create call sends, or a Refusal saying why there is none.
function requestObject(ts, sf, call) {
  const where = `the create call on line ${lineOf(sf, call.getStart(sf))}`;
  if (call.arguments.length === 0) throw new Refusal(`${where} passes no request`);
  const arg = unwrap(ts, call.arguments[0]);
  if (ts.isObjectLiteralExpression(arg)) return { object: arg, label: "inline request object" };
  if (!ts.isIdentifier(arg)) {
    throw new Refusal(
      `${where} passes \`${arg.getText(sf)}\`, which is neither an object literal nor a variable holding one`,
    );
  }
  const found = findDeclaration(ts, arg);
  if (!found)
    throw new Refusal(
      `${where} passes \`${arg.text}\`, and no declaration of \`${arg.text}\` encloses it`,
    );
  if (found.param)
    throw new Refusal(
      `${where} passes \`${arg.text}\`, a function parameter: the request is built elsewhere`,
    );
  const init = found.decl.initializer && unwrap(ts, found.decl.initializer);
  if (!init || !ts.isObjectLiteralExpression(init)) {
    throw new Refusal(
      `${where} passes \`${arg.text}\`, declared on line ${lineOf(sf, found.decl.getStart(sf))} with something other than an object literal`,
    );
  }
  const isConst = (found.list.flags & ts.NodeFlags.Const) !== 0;
  if (!isConst && isReassigned(ts, found.scope, arg.text)) {
    throw new Refusal(
      `${where} passes \`${arg.text}\`, which is reassigned: the request sent is not the one declared`,
    );
  }
  return { object: init, label: `request \`${arg.text}\`` };
}

// Where the run's model options live: X in the request's `model: X.name`.
function modelOptionsOf(ts, sf, object) {
  const prop = object.properties.find((p) => propertyName(ts, p) === "model");
  if (!prop || !ts.isPropertyAssignment(prop)) return null;
  let value = unwrap(ts, prop.initializer);
  while (
    ts.isBinaryExpression(value) &&
    [ts.SyntaxKind.QuestionQuestionToken, ts.SyntaxKind.BarBarToken].includes(
      value.operatorToken.kind,
    )
  ) {
    value = unwrap(ts, value.left);
  }
  if (!ts.isPropertyAccessExpression(value)) return null;
  return chainText(ts, value.expression);
}

// ---- planning the insertions ------------------------------------------------------------------

// True if `s` (the rest of one line) holds only whitespace and comments that end on the line.
function onlyTrivia(s) {
  for (;;) {
    s = s.replace(/^[ \t\r]+/, "");
    if (s === "" || s.startsWith("//")) return true;
    if (!s.startsWith("/*")) return false;
    const end = s.indexOf("*/", 2);
    if (end < 0) return false;
    s = s.slice(end + 2);
  }
}

function lineStart(text, pos) {
  return text.lastIndexOf("\n", pos - 1) + 1;
}

// The position just past the end of the line holding `pos`, if the rest of that line is trivia.
function nextLineIfRestIsTrivia(text, pos) {
  const nl = text.indexOf("\n", pos);
  if (nl < 0 || !onlyTrivia(text.slice(pos, nl))) return -1;
  return nl + 1;
}

function leadingWhitespace(text, pos) {
  const start = lineStart(text, pos);
  const before = text.slice(start, pos);
  return /^[ \t]*$/.test(before) ? before : null;
}

function spreadInsertion(ts, sf, text, object, options, eol) {
  const brace = object.getStart(sf);
  const afterBrace = brace + 1;
  const next = nextLineIfRestIsTrivia(text, afterBrace);
  if (next >= 0) {
    // `{` ends its line: the spread gets a line of its own, indented like the first property.
    const first = object.properties[0];
    let indent = first ? leadingWhitespace(text, first.getStart(sf)) : null;
    if (indent === null) {
      const outer = text.slice(lineStart(text, brace)).match(/^[ \t]*/)[0];
      indent = outer + (outer.includes("\t") ? "\t" : "  ");
    }
    return { pos: next, text: `${indent}...${FN}(${options}), // ${MARK}${eol}` };
  }
  return { pos: afterBrace, text: ` ...${FN}(${options}), /* ${MARK} */` };
}

function importInsertion(ts, sf, text, eol) {
  const imports = sf.statements.filter(
    (s) => ts.isImportDeclaration(s) || ts.isImportEqualsDeclaration(s),
  );
  const specifiers = sf.statements
    .filter(
      (s) =>
        (ts.isImportDeclaration(s) || ts.isExportDeclaration(s)) &&
        s.moduleSpecifier &&
        ts.isStringLiteral(s.moduleSpecifier),
    )
    .map((s) => s.moduleSpecifier);
  // Follow the file's style: its quotes, its semicolons, its relative-import extension.
  const last = imports[imports.length - 1];
  const lastSpec = last && ts.isImportDeclaration(last) ? last.moduleSpecifier.getText(sf) : null;
  const quote = lastSpec && lastSpec.startsWith("'") ? "'" : '"';
  const semi = last ? text[last.end - 1] === ";" : true;
  const relative = specifiers
    .map((s) => s.text)
    .filter((t) => t.startsWith("./") || t.startsWith("../"));
  const ext = relative.some((t) => t.endsWith(".js"))
    ? ".js"
    : relative.some((t) => t.endsWith(".ts"))
      ? ".ts"
      : "";
  const line = `import { ${FN} } from ${quote}./logprobs${ext}${quote}${semi ? ";" : ""} // ${MARK}${eol}`;

  let pos = last ? nextLineIfRestIsTrivia(text, last.end) : -1;
  if (pos < 0) {
    const anchor = imports[0] || sf.statements[0];
    if (anchor && leadingWhitespace(text, anchor.getStart(sf)) === "")
      pos = lineStart(text, anchor.getStart(sf));
  }
  if (pos < 0)
    throw new Refusal(
      "found no line to put the import on (after the last import, or before the first statement)",
    );
  return { pos, text: line };
}

function syntaxErrors(ts, name, text) {
  const out = ts.transpileModule(text, {
    fileName: name,
    reportDiagnostics: true,
    compilerOptions: {},
  });
  return (out.diagnostics || []).length;
}

// The insertions that patch an unpatched file, or a Refusal naming what was not found.
function plan(ts, rel, text, optionsOverride) {
  const sf = ts.createSourceFile(rel, text, ts.ScriptTarget.Latest, true, ts.ScriptKind.TS);
  const calls = [];
  const visit = (node) => {
    if (isCreateCall(ts, node)) calls.push(node);
    ts.forEachChild(node, visit);
  };
  visit(sf);
  if (calls.length === 0) throw new Refusal("no `.chat.completions.create(...)` call found");

  const eol = text.includes("\r\n") ? "\r\n" : "\n";
  const insertions = [];
  const described = [];
  const seen = new Set();
  for (const call of calls) {
    const { object, label } = requestObject(ts, sf, call);
    if (seen.has(object.pos)) continue;
    seen.add(object.pos);
    const own = object.properties
      .map((p) => propertyName(ts, p))
      .filter((n) => OWN_KEYS.includes(n));
    if (own.length) {
      throw new Refusal(
        `the ${label} (line ${lineOf(sf, object.getStart(sf))}) sets \`${own.join("`, `")}\` itself, which would override the patch; remove it there first`,
      );
    }
    const options = optionsOverride || modelOptionsOf(ts, sf, object);
    if (!options) {
      throw new Refusal(
        `the ${label} (line ${lineOf(sf, object.getStart(sf))}) has no \`model: X.name\` to tell where the run's model options are; ` +
          "pass them with --model-options EXPR (e.g. --model-options this.config)",
      );
    }
    insertions.push(spreadInsertion(ts, sf, text, object, options, eol));
    described.push(
      `${label} on line ${lineOf(sf, object.getStart(sf))}, model options \`${options}\``,
    );
  }
  insertions.push(importInsertion(ts, sf, text, eol));
  return { insertions, described };
}

function insert(text, insertions) {
  let out = text;
  for (const ins of [...insertions].sort((a, b) => b.pos - a.pos))
    out = out.slice(0, ins.pos) + ins.text + out.slice(ins.pos);
  return out;
}

function removeMarked(text) {
  return text.replace(IMPORT_RE, "").replace(LINE_SPREAD_RE, "").replace(INLINE_SPREAD_RE, "");
}

// ---- the state of a checkout ------------------------------------------------------------------

function readUtf8(abs, rel) {
  const raw = fs.readFileSync(abs);
  const text = raw.toString("utf8");
  if (!Buffer.from(text, "utf8").equals(raw)) throw new Refusal(`${rel} is not UTF-8 text`);
  return text;
}

// {state: "clean" | "patched", text, patched?, original?, described?} for one model file.
function inspectModelFile(ts, target, rel, optionsOverride) {
  const text = readUtf8(path.join(target, rel), rel);
  if (!text.includes(MARK)) {
    if (new RegExp(`\\b${FN}\\b`).test(text))
      throw new Refusal(
        `already uses \`${FN}\` without the patch's marker: not code the patch inserted`,
      );
    const { insertions, described } = plan(ts, rel, text, optionsOverride);
    const patched = insert(text, insertions);
    // Guards against a bad plan: the result must parse as well as the input and revert exactly.
    if (
      syntaxErrors(ts, rel, patched) > syntaxErrors(ts, rel, text) ||
      removeMarked(patched) !== text
    ) {
      throw new Refusal(
        "patching would not give well-formed, exactly revertible code (please report this)",
      );
    }
    return { state: "clean", text, patched, described };
  }
  const original = removeMarked(text);
  const options = [...text.matchAll(LINE_SPREAD_RE), ...text.matchAll(INLINE_SPREAD_RE)].map(
    (m) => m[1],
  );
  // Patched as apply would patch it: with the options read from the requests, or with the one
  // expression all spreads share (given by --model-options when the requests did not show it).
  const candidates = [null];
  if (options.length && options.every((o) => o === options[0])) candidates.push(options[0]);
  const matches = (override) => {
    try {
      return insert(original, plan(ts, rel, original, override).insertions) === text;
    } catch (err) {
      if (!(err instanceof Refusal)) throw err;
      return false;
    }
  };
  if (original.includes(MARK) || !options.length || !candidates.some(matches)) {
    throw new Refusal(
      `holds code marked "${MARK}" that is not what the patch inserts (edited after patching, or partly removed); ` +
        "restore the file from version control",
    );
  }
  return { state: "patched", text, original };
}

function helperTemplate(eol) {
  const text = fs.readFileSync(HELPER_TEMPLATE, "utf8");
  return eol === "\r\n" ? text.replace(/\n/g, "\r\n") : text;
}

function inspectTree(ts, target, optionsOverride) {
  const files = {};
  const problems = [];
  for (const rel of MODEL_FILES) {
    try {
      files[rel] = inspectModelFile(ts, target, rel, optionsOverride);
    } catch (err) {
      if (!(err instanceof Refusal)) throw err;
      problems.push(`${rel}: ${err.message}`);
    }
  }
  const eol = Object.values(files).some((f) => f.text.includes("\r\n")) ? "\r\n" : "\n";
  const helperAbs = path.join(target, HELPER);
  let helper = "absent";
  if (fs.existsSync(helperAbs)) {
    const current = fs.readFileSync(helperAbs, "utf8");
    helper = [helperTemplate("\n"), helperTemplate("\r\n")].includes(current) ? "ours" : "other";
    if (helper === "other")
      problems.push(`${HELPER}: exists and is not the file this patch adds; rename or remove it`);
  }
  if (problems.length) return { state: "refused", problems };
  const states = new Set(Object.values(files).map((f) => f.state));
  if (states.size === 1 && states.has("clean") && helper === "absent")
    return { state: "clean", files, eol };
  if (states.size === 1 && states.has("patched") && helper === "ours")
    return { state: "patched", files };
  // Half-patched: say which part is which.
  for (const rel of MODEL_FILES)
    problems.push(`${rel}: ${files[rel].state === "patched" ? "patched" : "not patched"}`);
  problems.push(`${HELPER}: ${helper === "ours" ? "present" : "missing"}`);
  return { state: "refused", problems, half: true };
}

// ---- writing ----------------------------------------------------------------------------------

// Writes every change or none: new contents go to temporary files first, then replace the files;
// a failure while replacing puts back what was already replaced.
function commit(changes) {
  const staged = [];
  try {
    for (const c of changes) {
      if (c.data === null) continue;
      const tmp = `${c.abs}.cua-rl-tmp`;
      fs.writeFileSync(tmp, c.data);
      if (c.old !== null) fs.chmodSync(tmp, fs.statSync(c.abs).mode);
      staged.push({ ...c, tmp });
    }
  } catch (err) {
    for (const s of staged) fs.rmSync(s.tmp, { force: true });
    throw err;
  }
  const done = [];
  try {
    for (const c of changes) {
      if (c.data === null) fs.unlinkSync(c.abs);
      else fs.renameSync(staged.find((s) => s.abs === c.abs).tmp, c.abs);
      done.push(c);
    }
  } catch (err) {
    for (const c of done) {
      if (c.old === null) fs.rmSync(c.abs, { force: true });
      else fs.writeFileSync(c.abs, c.old);
    }
    for (const s of staged) fs.rmSync(s.tmp, { force: true });
    throw err;
  }
}

// The model files' new contents: `patched` or `original`.
function modelFileChanges(target, verdict, which) {
  return MODEL_FILES.map((rel) => ({
    abs: path.join(target, rel),
    data: verdict.files[rel][which],
    old: verdict.files[rel].text,
  }));
}

// ---- main -------------------------------------------------------------------------------------

function refuse(mode, target, verdict) {
  const lines = [
    `apply.sh: refusing to ${mode} ${target}:`,
    ...verdict.problems.map((p) => `  ${p}`),
  ];
  if (verdict.half)
    lines.push(
      "The checkout is partly patched: restore these files from version control, then apply again.",
    );
  lines.push("Nothing was changed.");
  process.stderr.write(lines.join("\n") + "\n");
  process.exit(EXIT.refused);
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  if (!fs.existsSync(opts.target) || !fs.statSync(opts.target).isDirectory())
    fail(EXIT.noInput, `${opts.target} is not a directory`);
  const target = fs.realpathSync(opts.target);
  for (const rel of MODEL_FILES) {
    if (!fs.existsSync(path.join(target, rel)))
      fail(EXIT.refused, `${target}/${rel} not found: is ${target} a gbox-mini-agent checkout?`);
  }
  const ts = loadTypeScript(target);
  const verdict = inspectTree(ts, target, opts.modelOptions);
  if (verdict.state === "refused") refuse(opts.mode, target, verdict);

  if (opts.mode === "check") {
    if (verdict.state === "patched") process.stdout.write(`applied: ${target}\n`);
    else process.stdout.write(`not applied: ${target}\n`);
    process.exit(verdict.state === "patched" ? EXIT.ok : EXIT.notApplied);
  }
  if (opts.mode === "apply") {
    if (verdict.state === "patched") {
      process.stdout.write(`already applied, nothing to do: ${target}\n`);
      return;
    }
    const changes = modelFileChanges(target, verdict, "patched");
    changes.push({ abs: path.join(target, HELPER), data: helperTemplate(verdict.eol), old: null });
    commit(changes);
    process.stdout.write(`applied: ${target}\n`);
    for (const rel of MODEL_FILES)
      for (const d of verdict.files[rel].described) process.stdout.write(`  ${rel}: ${d}\n`);
    process.stdout.write(`  ${HELPER}: added\n`);
    return;
  }
  if (verdict.state === "clean") {
    process.stdout.write(`not applied, nothing to revert: ${target}\n`);
    return;
  }
  const changes = modelFileChanges(target, verdict, "original");
  const helperAbs = path.join(target, HELPER);
  changes.push({ abs: helperAbs, data: null, old: fs.readFileSync(helperAbs) });
  commit(changes);
  process.stdout.write(`reverted: ${target}\n`);
}

main();
