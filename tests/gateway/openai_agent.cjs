// A GUI agent as a TypeScript agent writes it with the official `openai` npm package: a system
// prompt, one user turn with a screenshot per step, the reply appended as returned. The test
// drives it over stdin/stdout: each input line is a JSON step
//   {"text", "image", "timeout_ms"?, "max_retries"?}
// and each output line reports that step: {"id", "message"} or {"error": "<class name>"}.
// A step that failed is sent again, identical, by the next step {"resend": true}.
const { createRequire } = require("node:module");
const readline = require("node:readline");

const sdk = createRequire(process.env.OPENAI_NODE_DIR + "/")("openai");
const client = new sdk.OpenAI({ baseURL: process.env.BASE_URL, apiKey: "unused" });
const messages = [{ role: "system", content: "You operate a phone." }];

async function step(spec) {
  if (!spec.resend) {
    messages.push({
      role: "user",
      content: [
        { type: "text", text: spec.text },
        { type: "image_url", image_url: { url: spec.image } },
      ],
    });
  }
  const options = {};
  if (spec.timeout_ms) options.timeout = spec.timeout_ms;
  if (spec.max_retries !== undefined) options.maxRetries = spec.max_retries;
  try {
    const r = await client.chat.completions.create({ model: "policy", messages }, options);
    messages.push(r.choices[0].message);
    return { id: r.id, message: r.choices[0].message };
  } catch (err) {
    return { error: err.constructor.name };
  }
}

const lines = readline.createInterface({ input: process.stdin });
(async () => {
  for await (const line of lines) {
    if (!line.trim()) continue;
    process.stdout.write(JSON.stringify(await step(JSON.parse(line))) + "\n");
  }
})();
