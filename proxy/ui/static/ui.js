// The live page: polls /ui/data (same origin) every refresh_s seconds while visible and
// draws what the proxy computed. Every figure is the server's; this file only formats.
// Panels: one function each, taking the data and drawing into its section of ui.html,
// listed in PANELS (its data comes from the panel of the same name in data.py).
"use strict";
(() => {
  const $ = (sel) => document.querySelector(sel);
  const sels = ["route", "model", "upstream"];
  let refreshes = 0, timer = null, inflight = false;

  const ms = (v) => (v == null ? "–" : v * 1000 < 100 ? (v * 1000).toFixed(1) : (v * 1000).toFixed(0));
  const num = (v, d) => (v == null ? "–" : v.toFixed(d || 0));
  const pct = (v, d) => (v == null ? "–" : (100 * v).toFixed(d || 0) + "%");
  const part = (v) => pct(v, v > 0 && v < 0.1 ? 1 : 0);
  const axisMs = (v) => (v * 1000 < 10 && v > 0 ? (v * 1000).toFixed(1) : (v * 1000).toFixed(0)) + " ms";
  const edgeLabel = (e) => (e < 1 ? `${+(e * 1000).toFixed(1)}ms` : `${+e.toFixed(2)}s`);

  const make = (tag) => document.createElement(tag);
  function cell(tr, text, key, tag) {
    const td = make(tag || "td");
    td.textContent = text;
    if (key) td.dataset.k = key;
    tr.appendChild(td);
    return td;
  }
  // A row of headers; a row of one cell across the table.
  function header(names) {
    const tr = make("tr");
    for (const c of names) cell(tr, c, null, "th");
    return tr;
  }
  function line(text, span) {
    const tr = make("tr");
    cell(tr, text).colSpan = span;
    return tr;
  }

  // The spans shown, [figures key, label]: the last minute once the proxy has one, and
  // since start; only since start until then. The first is the one the page leads with.
  const spans = (d) => (d.figures.window ? [["window", d.span.label], ["total", "since start"]] : [["total", "since start"]]);
  const spanTitle = (d) => spans(d).map((s) => s[1]).join(" and ") +
    (d.figures.window ? "" : `; the last minute in ${Math.ceil(d.span.minute_in_s)} s`);

  function selection() {
    const q = new URLSearchParams();
    for (const s of sels) { const v = $("#" + s).value; if (v) q.set(s, v); }
    return q;
  }

  function fillSelectors(choices, chosen) {
    for (const s of sels) {
      const box = $("#" + s), want = chosen[s] || "";
      const values = ["", ...choices[s]];
      const have = [...box.options].map((o) => o.value);
      if (have.join("\n") !== values.join("\n")) {
        box.replaceChildren(...values.map((v) => new Option(v || "all", v)));
      }
      box.value = want;
    }
  }

  function tile(value, key, label, since) {
    const div = make("div"), b = make("b"), span = make("span");
    div.className = "tile";
    b.textContent = value;
    b.dataset.k = key;
    span.textContent = label;
    div.append(b, span);
    if (since) {
      const more = make("span"), i = make("i");
      [i.textContent, i.dataset.k] = since;
      more.append("since start ", i);
      div.append(more);
    }
    return div;
  }

  function tiles(d) {
    const [k, span] = spans(d)[0], f = d.figures[k], t = d.figures.total;
    const items = [
      ["requests/s", (x) => num(x.requests_per_s, 2), "requests_per_s"],
      ["output tokens/s", (x) => num(x.output_tokens_per_s, 0), "output_tokens_per_s"],
      ["cache hit ratio", (x) => pct(x.cache_hit_ratio), "cache_hit_ratio"],
      ["streams below reading pace (5 tok/s)", (x) => pct(x.tpot && x.tpot.below_reading_pace), "tpot.below_reading_pace"],
      ["requests", (x) => num(x.requests), "requests"],
    ].map(([name, fmt, key]) => tile(fmt(f), `${k}.${key}`, `${name} · ${span}`, k === "total" ? null : [fmt(t), `total.${key}`]));
    items.splice(2, 0, tile(num(d.in_flight), "in_flight", "in flight · now, every route and model"));
    $("#tiles").replaceChildren(...items);
  }

  function percentiles(d) {
    $("#window-label").textContent = `(${spanTitle(d)})`;
    const head = header([""]), top = header([""]);
    for (const [, label] of spans(d)) {
      cell(top, label, null, "th").colSpan = 5;
      for (const c of ["n", "p50 ms", "p90 ms", "p99 ms", "mean ms"]) cell(head, c, null, "th").title = label;
    }
    const rows = [top, head];
    for (const [label, key] of [["TTFT", "ttft"], ["first answer", "ttfa"], ["ITL", "itl"], ["TPOT", "tpot"]]) {
      const tr = make("tr");
      cell(tr, label);
      for (const [span] of spans(d)) {
        const f = d.figures[span][key];
        cell(tr, f ? num(f.n) : "0", `${span}.${key}.n`);
        for (const p of ["p50", "p90", "p99", "mean"]) cell(tr, f ? ms(f[p]) : "–", `${span}.${key}.${p}`);
      }
      rows.push(tr);
    }
    $("#pct").replaceChildren(...rows);
  }

  function overTime(d) {
    const s = d.series, t = s.t;
    const pts = (key) => t.map((x, i) => (s[key][i] === null ? null : [x, s[key][i]]));
    const opts = { xfmt: (v) => `${Math.round(v)} s`, yfmt: axisMs, xlabel: "seconds ago", xmax: 0, empty: "collecting: points every 5 s while this page is open" };
    for (const h of ["ttft", "ttfa", "itl"]) {
      Charts.lines(document.querySelector(`[data-chart=${h}-time]`), [
        { name: "p50", cls: "s0", points: pts(`${h}.p50`) },
        { name: "p90", cls: "s1", points: pts(`${h}.p90`) },
        { name: "p99", cls: "s2", points: pts(`${h}.p99`) },
      ], opts);
    }
    Charts.lines(document.querySelector("[data-chart=throughput-time]"), [
      { name: "requests/s", cls: "s0", points: pts("requests_per_s") },
      { name: "output tokens/s ÷ 100", cls: "s3", points: t.map((x, i) => (s.output_tokens_per_s[i] === null ? null : [x, s.output_tokens_per_s[i] / 100])) },
    ], { ...opts, yfmt: (v) => (+v.toFixed(2)).toString() });
  }

  function shares(counts) {
    if (!counts) return null;
    const total = counts.reduce((a, v) => a + v, 0);
    return total > 0 ? counts.map((v) => v / total) : null;
  }

  function histograms(d) {
    for (const name of ["ttft", "itl"]) {
      const h = d.hist[name === "ttft" ? "llm_proxy_time_to_first_token_seconds" : "llm_proxy_inter_token_latency_seconds"];
      const labels = [...h.edges.map(edgeLabel), "+Inf"];
      const bands = [];
      if (name === "itl") {
        const fast = h.edges.findIndex((e) => e >= d.bands.fast_s);
        const slow = h.edges.findIndex((e) => e >= d.bands.reading_pace_s);
        if (fast >= 0 && slow > fast) {
          bands.push({ from: 0, to: fast, cls: "fast", label: "≥ 20 tok/s" });
          bands.push({ from: fast + 1, to: slow, cls: "mid", label: "5–20" });
          bands.push({ from: slow + 1, to: labels.length - 1, cls: "slow", label: "< 5 tok/s: slower than reading" });
        }
      }
      Charts.bars(document.querySelector(`[data-chart=${name}-hist]`), labels,
        spans(d).map(([k, label]) => ({ name: label, cls: k === "window" ? "s0" : "s4", values: shares(h[k]) })),
        { yfmt: (v) => `${Math.round(v * 100)}%`, bands });
    }
  }

  function timeSplit(d) {
    const rows = [];
    for (const [span, label] of spans(d)) {
      const split = d.figures[span].time;
      if (!split) continue;
      const p = split.parts_s;
      rows.push({ label: `${label} (${ms(split.request_s)} ms)`, parts: [
        { name: "queue", value: p.queue, cls: "s2" },
        { name: "proxy overhead", value: p.overhead, cls: "s4" },
        { name: "to first token", value: p.first_token, cls: "s1" },
        { name: "decode", value: p.decode, cls: "s0" },
      ] });
    }
    Charts.stack(document.querySelector("[data-chart=time-split]"), rows, { fmt: (v) => `${ms(v)} ms` });
  }

  function outcomes(d) {
    const sp = spans(d), t = d.figures.total;
    const names = [...new Set(sp.flatMap(([k]) => Object.keys(d.figures[k].outcomes)))];
    const rows = [header(["stream outcome", ...sp.map((s) => s[1])]), ...names.map((n) => {
      const tr = make("tr");
      cell(tr, n).className = n === "completed" ? "" : "bad";
      for (const [k] of sp) cell(tr, num(d.figures[k].outcomes[n] || 0), `${k}.outcomes.${n}`);
      return tr;
    })];
    const tr = make("tr");
    cell(tr, "HTTP status, since start");
    cell(tr, Object.entries(t.codes).map(([k, v]) => `${k} ${num(v)}`).join(", ") || "–").colSpan = sp.length;
    rows.push(tr);
    $("#outcomes").replaceChildren(...rows);
  }

  const TIPS = {
    "decode tok/s": "Output tokens/s per stream after its first token: median of 1 / TPOT",
    errors: "Requests the upstream or the proxy failed: streams that ended other than completed or the client leaving (client_disconnected, client_stalled), and requests not streamed answered 5xx; not the proxy's refusals (rejected)",
    "missed cache": "Prompt tokens sent before that the provider's cache did not serve, as a share of prompt tokens (the prompt-cache doctor's)",
  };

  function byUpstream(d) {
    const t = d.table, on = d.selection;
    $("#by-span").textContent = `(${spans(d)[0][1]})`;
    const names = ["upstream", "model", ...(t.by_route ? ["route"] : [])];
    const cols = [...names, "requests", "TTFT p50 ms", "TTFT p95 ms", "first answer p50 ms", "ITL p50 ms", "decode tok/s", "errors", "missed cache"];
    const head = header(cols);
    for (const th of head.children) Object.assign(th, { title: TIPS[th.textContent] || "", className: names.includes(th.textContent) ? "l" : "" });
    const rows = [head, ...t.rows.map((r) => {
      const tr = make("tr");
      const pick = { route: t.by_route ? r.route : "", model: r.model, upstream: r.upstream };
      tr.className = sels.every((s) => on[s] === pick[s]) ? "pick on" : "pick";
      tr.tabIndex = 0;
      tr.onclick = () => choose(pick);
      tr.onkeydown = (e) => { if (e.key === "Enter") choose(pick); };
      for (const s of names) cell(tr, r[s]).className = "l";
      for (const v of [num(r.requests), ms(r.ttft_p50), ms(r.ttft_p95), ms(r.ttfa_p50), ms(r.itl_p50), num(r.decode_tok_s, r.decode_tok_s < 10 ? 1 : 0)]) cell(tr, v);
      const e = cell(tr, r.errors ? `${num(r.errors)} (${part(r.error_share)})` : "0");
      e.title = Object.entries(r.errors_by).map(([k, v]) => `${k}: ${num(v)}`).join("\n") || TIPS.errors;
      if (r.errors) e.className = "bad";
      cell(tr, t.missed_measured ? part(r.missed_cache) : "–").title =
        t.missed_measured ? `${num(r.missed_tokens)} of ${num(r.prompt_tokens)} prompt tokens` : "not measured";
      return tr;
    })];
    const tail = t.rows.length ? (t.more ? `and ${t.more} more` : "") : "no requests";
    if (tail) rows.push(line(tail, cols.length));
    $("#by").replaceChildren(...rows);
  }

  function slow(d) {
    const rows = [header(["request id", "route", "model", "TTFT ms", "first answer ms", "total ms", "prompt tok", "cached", "output tok", "outcome", "ago"]), ...d.slow.map((r) => {
      const tr = make("tr");
      cell(tr, r.request_id).className = "id";
      cell(tr, r.route); cell(tr, r.model);
      cell(tr, ms(r.ttft_s)); cell(tr, ms(r.ttfa_s)); cell(tr, ms(r.duration_s));
      cell(tr, num(r.prompt_tokens)); cell(tr, num(r.cached_prompt_tokens)); cell(tr, num(r.completion_tokens));
      cell(tr, r.outcome).className = r.outcome === "completed" ? "" : "bad";
      cell(tr, `${Math.round(r.ago_s)} s`);
      return tr;
    })];
    if (!d.slow.length) rows.push(line("none in the last minute", 11));
    $("#slow").replaceChildren(...rows);
  }

  const para = (cls, ...kids) => { const p = make("p"); p.className = cls; p.append(...kids); return p; };
  const estimated = (f) => f.estimated_requests ? `; ${f.estimated_requests} with tokens estimated (no usage)` : "";
  const fitText = (f, label) => !f ? `${label}: not yet` : f.usable
    ? `${label} ${f.summary} (± ${num(f.stderr_ms_per_1k_tokens, 1)} ms per 1,000); ${f.model_words} (${f.requests} streams${estimated(f)})`
    : `${label}: ${f.status === "one_length" ? "prompts of one length" : f.requests < 20 ? (f.skipped && !f.requests ? "no token counts" : `${f.requests} streams, 20 needed`) : "not clear yet"}${estimated(f)}`;
  const ORDER = { lever: "", not_a_lever: "not worth it", too_little_data: "too little data", unknown: "not measured" };

  function whatToFix(d) {
    const f = d.fix;
    $("#fix-span").textContent = "(since start)";
    const out = f.selections.map((s, n) => {
      const div = make("div"), h = make("h3"), ol = make("ol");
      div.className = "fix";
      h.textContent = `${s.route} · ${s.model} · ${s.upstream} `;
      h.dataset.k = `fix.${n}.key`;
      h.append(Object.assign(make("span"), { className: "muted", textContent: `(${s.requests} request${s.requests === 1 ? "" : "s"})` }));
      const worth = s.levers.filter((l) => l.status === "lever");
      worth.forEach((l, i) => {
        const li = make("li"), b = make("b"), v = make("span");
        [b.textContent, b.dataset.k] = [l.name, `fix.${n}.lever.${i}`];
        [v.textContent, v.dataset.k] = [` saves ${num(l.saves_ms)} ms: `, `fix.${n}.lever.${i}.saves_ms`];
        li.title = Object.entries(l.numbers).map(([k, x]) => `${k}: ${x}`).join("\n");
        li.append(b, v, l.sentence);
        ol.append(li);
      });
      const rest = Object.entries(ORDER).slice(1).map(([st, label]) => {
        const ls = s.levers.filter((l) => l.status === st);
        return ls.length ? `${label}: ${ls.map((l) => l.name + (l.saves_ms == null ? "" : ` ${num(l.saves_ms)} ms`)).join(", ")}` : "";
      }).filter(Boolean).join(" · ");
      div.append(h, worth.length ? ol : para("", "Nothing worth acting on."),
        para("note", "Prefill fit: " + [fitText(s.fit.window, "last minute"), fitText(s.fit.total, "since start")].join("; ")
          + (s.first_token.prefill_from === "engine" ? "; prefill: the engine's timings" : "")),
        para("note", rest));
      return div;
    });
    if (f.more) out.push(para("note", `and ${f.more} more: pick a route, model or upstream`));
    $("#fix").replaceChildren(...(out.length ? out : [para("muted", "no requests measured yet")]));
  }

  function promptCache(d) {
    const c = d.prompt_cache, sp = spans(d).filter(([k]) => c[k]), lead = c[sp[0][0]];
    $("#pc-span").textContent = `(${sp.map((s) => s[1]).join(" and ")})`;
    const rows = [header(["prompt tokens", ...sp.flatMap(([, l]) => [`${l}: tokens/s`, "share"])])];
    for (const [k, label] of [["prompt", "all"], ["repeated", "repeated: a cache could serve them"], ["cached", "reported cached by the upstream"], ["missed", "missed: repeated, not cached"]]) {
      const tr = make("tr"), known = c.measured || k === "prompt" || k === "cached";
      cell(tr, label);
      for (const [s] of sp) {
        cell(tr, known ? num(c[s][k].per_s, 1) : "–", `pc.${s}.${k}.per_s`);
        cell(tr, known ? part(c[s][k].share) : "–", `pc.${s}.${k}.share`);
      }
      rows.push(tr);
    }
    $("#pc").replaceChildren(...rows);
    const cost = make("b"), covers = lead.missed_ms_covers;
    [cost.textContent, cost.dataset.k] = [lead.missed_ms == null ? "unknown (no prefill fit yet)" : `${num(lead.missed_ms, 1)} ms`, "pc.missed_ms"];
    const br = lead.breaks.map((b, i) => {
      const r = make("b"), n = make("span"), s = make("span"), e = b.example;
      [r.textContent, r.dataset.k] = [b.reason, `pc.break.${i}`];
      [n.textContent, n.dataset.k] = [` ${num(b.count)}`, `pc.break.${i}.count`];
      [s.textContent, s.dataset.k] = [b.sentence, `pc.break.${i}.sentence`];
      return para("", r, n, e ? ` · latest: ${e.route} ${e.model} ${e.upstream}, ${Math.round(e.ago_s)} s ago: ` : ": ", s);
    });
    $("#pc-breaks").replaceChildren(
      c.measured ? para("", `Missed cache, per request, in first-token time (${sp[0][1]}, by the prefill fit): `, cost,
        covers != null && covers < 1 ? ` (covers ${part(covers)} of the missed tokens)` : "") : para("muted", "not measured: the prompt-cache doctor is off (serve --prefix-doctor turns it on)"),
      para("note", `Where prompts stopped repeating, by reason (${sp[0][1]}, ${num(lead.breaks_total)} breaks):`),
      ...(br.length ? br : [para("muted", "none")]));
    const idx = d.prefix_index;
    $("#pc-note").textContent = "Repeated: the leading prompt bytes a recent request to the same upstream and model sent (the prompt-cache doctor). Break positions are block-rounded (256 bytes), from this process only (with --workers, the worker that answered); counts sum every worker. " +
      (idx && idx.index === "shared" ? "" : (idx && idx.note) || "Per-process index: with N replicas it finds about 1/N of the repeats.");
  }

  const PANELS = [tiles, byUpstream, whatToFix, promptCache, percentiles, overTime, histograms, timeSplit, outcomes, slow];

  function draw(d) {
    fillSelectors(d.choices, d.selection);
    const up = Math.round(d.uptime_s);
    for (const panel of PANELS) panel(d);
    refreshes += 1;
    document.body.dataset.refreshes = String(refreshes);
    document.body.dataset.generated = String(d.generated_ms);
    document.body.dataset.selection = JSON.stringify(d.selection);
    $("#status").textContent = `updated ${new Date(d.generated_ms).toLocaleTimeString()} · up ${Math.floor(up / 60)}:${String(up % 60).padStart(2, "0")}`;
    $("#status").className = "muted";
  }

  // A new selection: in the URL (a link to this view), then its figures.
  function changed() {
    const q = selection().toString();
    history.replaceState(null, "", location.pathname + (q ? "?" + q : ""));
    refresh();
  }

  function choose(pick) {
    for (const s of sels) {
      const box = $("#" + s), v = pick[s];
      if (![...box.options].some((o) => o.value === v)) box.add(new Option(v, v));
      box.value = v;
    }
    changed();
  }

  async function refresh() {
    if (inflight) return;
    inflight = true;
    const q = selection().toString();
    try {
      const r = await fetch(location.pathname.replace(/\/?$/, "/data") + (q ? "?" + q : ""), { cache: "no-store" });
      const body = await r.json();
      if (!r.ok) {
        $("#status").textContent = (body.error && body.error.message) || `HTTP ${r.status}`;
        $("#status").className = "bad";
        if (body.error && body.error.code === "unknown_selector") {
          for (const s of sels) $("#" + s).value = "";  // e.g. after a restart: back to all
          history.replaceState(null, "", location.pathname);
        }
        return;
      }
      if (q === selection().toString()) draw(body);  // else chosen meanwhile: asked again below
    } catch (e) {
      $("#status").textContent = `no answer from the proxy (${e.message}); retrying`;
      $("#status").className = "bad";
    } finally {
      inflight = false;
      if (q !== selection().toString()) refresh();
    }
  }

  function schedule(seconds) {
    clearInterval(timer);
    timer = document.hidden ? null : setInterval(refresh, seconds * 1000);
  }

  const start = new URLSearchParams(location.search);
  for (const s of sels) {
    const v = start.get(s);
    if (v) $("#" + s).replaceChildren(new Option("all", ""), new Option(v, v));
    $("#" + s).value = v || "";
    $("#" + s).addEventListener("change", changed);
  }
  document.addEventListener("visibilitychange", () => { schedule(1); if (!document.hidden) refresh(); });
  schedule(1);
  refresh();
})();
