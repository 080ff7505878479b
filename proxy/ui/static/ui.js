// The live page: polls /ui/data (same origin) every refresh_s seconds while visible and
// draws what the proxy computed. Every figure is the server's; this file only formats.
"use strict";
(() => {
  const $ = (sel) => document.querySelector(sel);
  const sels = ["route", "model", "upstream"];
  let refreshes = 0, timer = null, inflight = false;

  const ms = (v) => (v === null || v === undefined ? "–" : v * 1000 < 100 ? (v * 1000).toFixed(1) : (v * 1000).toFixed(0));
  const num = (v, d) => (v === null || v === undefined ? "–" : v.toFixed(d || 0));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%");
  const axisMs = (v) => (v * 1000 < 10 && v > 0 ? (v * 1000).toFixed(1) : (v * 1000).toFixed(0)) + " ms";
  const edgeLabel = (e) => (e < 1 ? `${+(e * 1000).toFixed(1)}ms` : `${+e.toFixed(2)}s`);

  function cell(tr, text, key, tag) {
    const td = document.createElement(tag || "td");
    td.textContent = text;
    if (key) td.dataset.k = key;
    tr.appendChild(td);
    return td;
  }

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

  function tiles(d) {
    const w = d.figures.window, t = d.figures.total;
    const items = [
      ["requests/s", num(w && w.requests_per_s, 2), "window.requests_per_s", `since start ${num(t.requests_per_s, 2)}`],
      ["output tokens/s", num(w && w.output_tokens_per_s, 0), "window.output_tokens_per_s", `since start ${num(t.output_tokens_per_s, 0)}`],
      ["in flight", num(d.in_flight), "in_flight", "now, every route"],
      ["cache hit ratio", pct(w && w.cache_hit_ratio), "window.cache_hit_ratio", `since start ${pct(t.cache_hit_ratio)}`],
      ["below reading pace", pct(w && w.tpot && w.tpot.below_reading_pace), "window.tpot.below_reading_pace", "streams under 5 tok/s"],
      ["requests", num(t.requests), "total.requests", `last minute ${num(w && w.requests)}`],
    ];
    $("#tiles").replaceChildren(...items.map(([name, value, key, sub]) => {
      const div = document.createElement("div");
      div.className = "tile";
      const b = document.createElement("b");
      b.textContent = value;
      b.dataset.k = key;
      const label = document.createElement("span");
      label.textContent = `${name} · ${sub}`;
      div.append(b, label);
      return div;
    }));
  }

  function percentiles(d) {
    const table = $("#pct");
    const head = document.createElement("tr");
    cell(head, "", null, "th");
    for (const span of ["last minute", "since start"]) {
      for (const c of ["n", "p50 ms", "p90 ms", "p99 ms", "mean ms"]) cell(head, `${c}`, null, "th").title = span;
    }
    const spans = document.createElement("tr");
    cell(spans, "", null, "th");
    const a = cell(spans, "last minute", null, "th"); a.colSpan = 5;
    const b = cell(spans, "since start", null, "th"); b.colSpan = 5;
    const rows = [spans, head];
    for (const [label, key] of [["TTFT", "ttft"], ["first answer", "ttfa"], ["ITL", "itl"], ["TPOT", "tpot"]]) {
      const tr = document.createElement("tr");
      cell(tr, label);
      for (const span of ["window", "total"]) {
        const f = d.figures[span] && d.figures[span][key];
        cell(tr, f ? num(f.n) : "0", `${span}.${key}.n`);
        for (const p of ["p50", "p90", "p99", "mean"]) cell(tr, f ? ms(f[p]) : "–", `${span}.${key}.${p}`);
      }
      rows.push(tr);
    }
    table.replaceChildren(...rows);
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
      Charts.bars(document.querySelector(`[data-chart=${name}-hist]`), labels, [
        { name: "last minute", cls: "s0", values: shares(h.window) },
        { name: "since start", cls: "s4", values: shares(h.total) },
      ], { yfmt: (v) => `${Math.round(v * 100)}%`, bands });
    }
  }

  function timeSplit(d) {
    const rows = [];
    for (const [label, span] of [["last minute", "window"], ["since start", "total"]]) {
      const f = d.figures[span], split = f && f.time;
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
    const w = (d.figures.window && d.figures.window.outcomes) || {}, t = d.figures.total.outcomes;
    const names = [...new Set([...Object.keys(t), ...Object.keys(w)])];
    const head = document.createElement("tr");
    for (const c of ["stream outcome", "last minute", "since start"]) cell(head, c, null, "th");
    const rows = [head, ...names.map((n) => {
      const tr = document.createElement("tr");
      cell(tr, n).className = n === "completed" ? "" : "bad";
      cell(tr, num(w[n] || 0), `window.outcomes.${n}`);
      cell(tr, num(t[n] || 0), `total.outcomes.${n}`);
      return tr;
    })];
    const codes = d.figures.total.codes;
    const tr = document.createElement("tr");
    cell(tr, "HTTP status, since start");
    const td = cell(tr, Object.entries(codes).map(([k, v]) => `${k} ${num(v)}`).join(", ") || "–");
    td.colSpan = 2;
    rows.push(tr);
    $("#outcomes").replaceChildren(...rows);
  }

  function slow(d) {
    const head = document.createElement("tr");
    for (const c of ["request id", "route", "model", "TTFT ms", "first answer ms", "total ms", "prompt tok", "cached", "output tok", "outcome", "ago"]) cell(head, c, null, "th");
    const rows = [head, ...d.slow.map((r) => {
      const tr = document.createElement("tr");
      cell(tr, r.request_id).className = "id";
      cell(tr, r.route); cell(tr, r.model);
      cell(tr, ms(r.ttft_s)); cell(tr, ms(r.ttfa_s)); cell(tr, ms(r.duration_s));
      cell(tr, num(r.prompt_tokens)); cell(tr, num(r.cached_prompt_tokens)); cell(tr, num(r.completion_tokens));
      cell(tr, r.outcome).className = r.outcome === "completed" ? "" : "bad";
      cell(tr, `${Math.round(r.ago_s)} s`);
      return tr;
    })];
    if (!d.slow.length) { const tr = document.createElement("tr"); cell(tr, "none in the last minute").colSpan = 11; rows.push(tr); }
    $("#slow").replaceChildren(...rows);
  }

  function draw(d) {
    fillSelectors(d.choices, d.selection);
    const up = Math.round(d.uptime_s);
    $("#window-label").textContent = d.figures.window ? `(last ${Math.round(d.window_s)} s and since start)` : "(since start; the last minute fills while this page is open)";
    tiles(d); percentiles(d); overTime(d); histograms(d); timeSplit(d); outcomes(d); slow(d);
    refreshes += 1;
    document.body.dataset.refreshes = String(refreshes);
    document.body.dataset.generated = String(d.generated_ms);
    document.body.dataset.selection = JSON.stringify(d.selection);
    $("#status").textContent = `updated ${new Date(d.generated_ms).toLocaleTimeString()} · up ${Math.floor(up / 60)}:${String(up % 60).padStart(2, "0")}`;
    $("#status").className = "muted";
  }

  async function refresh() {
    if (inflight) return;
    inflight = true;
    try {
      const q = selection().toString();
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
      draw(body);
    } catch (e) {
      $("#status").textContent = `no answer from the proxy (${e.message}); retrying`;
      $("#status").className = "bad";
    } finally {
      inflight = false;
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
    $("#" + s).addEventListener("change", () => {
      history.replaceState(null, "", "?" + selection().toString());
      refresh();
    });
  }
  document.addEventListener("visibilitychange", () => { schedule(1); if (!document.hidden) refresh(); });
  schedule(1);
  refresh();
})();
