"""The HELP texts of the metrics whose meaning takes a paragraph.

:mod:`proxy.metrics` registers the metrics; these are their definitions, in the words
``/metrics`` and the metrics reference page (docs/reference/metrics.md) show.
"""

from __future__ import annotations

TTFT_HELP = (
    "Time to first token: from the proxy receiving the request (before any queueing) until "
    "the first event carrying generated output, reasoning included, was handed on to the "
    "client. Chat: non-empty delta.content, delta.reasoning_content or delta.reasoning, "
    "delta.tool_calls, delta.refusal, delta.function_call; completions: choices[].text; "
    "Responses: a non-empty delta in response.output_text/refusal/reasoning_text/"
    "reasoning_summary_text/function_call_arguments/custom_tool_call_input/"
    "mcp_call_arguments/code_interpreter_call_code/audio/audio.transcript .delta; Messages: "
    "content_block_delta with text_delta, thinking_delta or input_json_delta. Opening events "
    "(role-only chunk, response.created, message_start) are never tokens. Streams only."
)
NO_FIRST_TOKEN_HELP = (
    "Streams that ended before any output event, without completing: answered 2xx (the "
    "client left, the upstream broke off, went silent or sent an error event, the proxy "
    "shut down), or not answered at all when the client left or the proxy shut down "
    "(queued in the proxy, or an upstream that sent no headers), by how long the client "
    "had waited, from the proxy receiving the request "
    "until the stream ended: the waits time to first token never observes, which the TTFT "
    "SLO counts as misses past its target. Buckets: the TTFT histogram's (--ttft-buckets)."
)
TTFA_HELP = (
    "Time to first answer token: as time to first token, but until the first output event "
    "that is not reasoning (not delta.reasoning_content/reasoning, not "
    "response.reasoning_text/reasoning_summary_text deltas, not thinking_delta). With a "
    "reasoning model, when the user sees the answer start. Streams only."
)
TTFB_HELP = (
    "Time to first byte: from the proxy receiving the request until the first response body "
    "bytes were handed on to the client (OpenTelemetry's time to first chunk); time to first "
    "token minus this is how long an upstream that answers at once keeps the user waiting. "
    "Streams only."
)
ITL_HELP = (
    "Inter-token latency: every gap between consecutive output-bearing events (reasoning and "
    "answer alike) handed on to the client, one observation per gap. Streams only."
)
TPOT_HELP = (
    "Time per output token per request: (last output event - first output event) / "
    "(completion_tokens - 1), completion_tokens from the upstream's usage; only when "
    "completion_tokens >= 2. Streams only."
)

# The prompt-cache doctor's metrics (proxy/doctor/job.py): what "repeated" and
# "missed" mean, in one place.
_REPEATED = (
    "The repeated prefix of a prompt is its longest run of leading 256-byte blocks "
    "(cut per part: tools, system, messages, ... in the order the provider renders them) "
    "that a recent request to the same upstream, model and prompt_cache_key/cache_salt "
    "sent within --prefix-window (by default 5 minutes), found in the doctor's index of "
    "keyed block hashes. That index is each process's own unless the config file has a "
    "[cache-index] table: then every worker and replica shares one on Redis or Valkey. "
    "A per-process index finds a repeat only when the earlier request was served by the "
    "same process: behind a load balancer, or with --workers, it misses the others "
    "(with N replicas taking turns, a conversation's next turn is found about 1 time in "
    "N), so these numbers are then a lower bound. "
)
_TOKENS = (
    "Tokens are estimated from bytes at the request's own ratio, usage prompt tokens over "
    "the prompt's bytes (where the upstream sent no usage, over the proxy's own estimate "
    "of the prompt tokens, which the request log marks tokens_estimated). "
)
PREFIX_HELP = {
    name: text.strip()
    for name, text in {
        "repeated": "Estimated tokens of repeated prompt prefix, summed over measured requests "
        "answered 2xx. " + _REPEATED + _TOKENS,
        "missed": "Prompt tokens repeated but not reported cached, summed over measured requests "
        "answered 2xx: the repeated prefix's tokens (without the prompt's last token, rounded "
        "down to the upstream's caching step: 128 tokens on OpenAI's APIs before the GPT-5.6 "
        "family, 1 from it on and on Anthropic's, cache_granularity_tokens per upstream) minus the cached tokens the upstream reported "
        "(cached_tokens, cache_read_input_tokens), floored at 0. Only where the usage reports "
        "cached tokens at all (an absent field is unknown, never 0); 0 when that cacheable "
        "part is shorter than the upstream's minimum cacheable prefix (1024 tokens on "
        "OpenAI's APIs, per model on Anthropic's and Gemini's, min_cacheable_tokens per "
        "upstream). " + _REPEATED + _TOKENS,
        "unmarked": "Of llm_proxy_prompt_cache_missed_tokens_total, the tokens past the last "
        "cache breakpoint, on requests whose provider caches only the prefixes a breakpoint "
        "marks: Anthropic's Messages API without the request-level cache_control (breakpoints: "
        "cache_control on a tool, a system block or a content block), OpenAI's APIs with "
        "prompt_cache_options.mode explicit (prompt_cache_breakpoint on a content part). No "
        "cache was asked to serve them: a breakpoint after the stable part would. The rest of "
        "the missed tokens were asked for and not served. Nothing is counted for requests "
        "whose upstream may cache any repeated prefix. " + _TOKENS,
        "breaks": "Requests whose prompt stopped repeating a recent request's prefix, by why "
        "(reason: settings_changed: a request setting such as response_format, tools_changed, "
        "system_changed, instructions_changed, context_changed, "
        "message_changed, prompt_changed, variable_before_stable: a short changed run ahead "
        "of text seen before, expired: sent longer ago than --prefix-window, concurrent: sent "
        "only by requests whose prefill was done after this one arrived and before its own "
        "was, model_changed, "
        "cache_key_changed, first_seen) and the kind of part where it broke (part: settings, "
        "tools, system, instructions, context, message, input, prompt; none for the reasons about "
        "the whole prompt). A conversation that grew by a turn, or a new last message after "
        "the same history, is not a break. Positions are in the request log and the span. "
        + _REPEATED,
        "ratio": "Repeated prompt prefix as a share of the prompt, in bytes, per measured "
        "request answered 2xx (0: nothing repeated, 1: the whole prompt). " + _REPEATED,
        "missed_hist": "Prompt tokens repeated but not reported cached, per measured request "
        "answered 2xx whose usage reports cached tokens; the per-request view of "
        "llm_proxy_prompt_cache_missed_tokens_total (same definition). " + _TOKENS,
        "unchecked": "Measured requests answered 2xx that the prompt-cache doctor did not "
        "examine, so that none of its other metrics counts them, by why (reason): store_down: "
        "the shared index ([cache-index]) failed recently and is not asked until its pause "
        "(retry_ms, doubling while it fails, at most 30 s) is over; store_timeout: it did not "
        "answer within timeout_ms; store_error: it refused the connection or answered an "
        "error; too_large: a prompt estimated past the per-request key cap (32768 keys, "
        "up to four per estimated 256-byte block: a prompt examined holds at most 2 MiB of "
        "text, or 8,000 parts; in process also an eighth of --prefix-index-bytes), not examined so that it neither holds the doctor for seconds nor "
        "pushes other requests' prompts out of the index; busy: the doctor's threads had a full backlog; late: the answer "
        "was relayed before the examination ended and the finish waited no longer (its limit, 0.5 s); "
        "failed: the doctor raised (logged with its traceback). The request itself was "
        "relayed as always.",
        "index_seconds": "Round trip of one exchange with the prompt-cache doctor's shared "
        "index ([cache-index]: Redis or Valkey), from sending a request's block keys to having "
        "the store's answer, one observation per measured request answered 2xx that was sent "
        "to it, by result (ok; timeout: no answer within timeout_ms; error: refused or "
        "answered an error). Taken in the doctor's worker thread after the response headers, "
        "never on the request's path. No samples with the per-process index.",
    }.items()
}
