// Added by cua-rl's logprob patch (patches/gbox-mini-agent/apply.sh; `--revert` deletes this file):
// the request fields that make an OpenAI-compatible vLLM server return the sampled token ids,
// their logprobs and the prompt ids.

export interface LogprobOptions {
  /** Request logprobs and token ids (default true; set false to restore the unpatched request). */
  logprobs?: boolean;
  /** Alternatives per sampled token (top_logprobs); omitted when unset or 0. */
  topLogprobs?: number;
}

export interface LogprobRequestFields {
  logprobs?: boolean;
  top_logprobs?: number;
  return_token_ids?: boolean;
}

export function logprobRequestFields(options: unknown): LogprobRequestFields {
  const opts = (typeof options === "object" && options !== null ? options : {}) as LogprobOptions;
  if (opts.logprobs === false) {
    return {};
  }
  const fields: LogprobRequestFields = { logprobs: true, return_token_ids: true };
  if (typeof opts.topLogprobs === "number" && opts.topLogprobs > 0) {
    fields.top_logprobs = Math.floor(opts.topLogprobs);
  }
  return fields;
}
