// The bench report: draws the run (and the run it is compared with) from the JSON
// inlined in the page. Every number is computed by the bench; this file only draws.
"use strict";
(() => {
  const data = JSON.parse(document.getElementById("run-data").textContent);
  const runs = data.runs;
  const $ = (sel) => document.querySelector(sel);
  const chart = (name) => document.querySelector(`[data-chart=${name}]`);
  const ms = (v) => (v === null || v === undefined ? "–" : (v * 1000).toFixed(1));
  const axisMs = (v) => (v >= 1 ? `${+v.toPrecision(3)} s` : `${+(v * 1000).toPrecision(3)} ms`);
  const named = (run, what) => (runs.length > 1 ? `${run.name}: ${what}` : what);
  const CLIENT = ["s0", "s1"], PROXY = ["hollow2", "hollow"];

  function row(cells, tag, attrs) {
    const tr = document.createElement("tr");
    cells.forEach((text, i) => {
      const td = document.createElement(tag || "td");
      td.textContent = text;
      if (attrs) attrs(td, i);
      tr.appendChild(td);
    });
    return tr;
  }

  function tables() {
    const host = $("#tables");
    runs.forEach((run, k) => {
      const h = document.createElement("h2");
      h.textContent = run.name;
      const table = document.createElement("table");
      table.dataset.run = String(k);
      run.table.forEach((cells, r) => {
        table.appendChild(row(cells, r ? "td" : "th", (td, c) => { td.dataset.cell = `${r},${c}`; }));
      });
      const lines = document.createElement("pre");
      lines.className = "note";
      lines.dataset.run = String(k);
      lines.textContent = run.lines.join("\n");
      if (runs.length > 1) host.appendChild(h);
      host.append(table, lines);
    });
  }

  function cdf(name) {
    const series = [];
    runs.forEach((run, k) => {
      const c = run.cdf[name];
      series.push({ name: named(run, "client"), cls: CLIENT[k] + (k ? " dash" : ""), step: true, points: c.client });
      if (c.proxy.length) series.push({ name: named(run, "proxy buckets"), cls: PROXY[k], dots: true, points: c.proxy });
    });
    // The axis starts at the smallest gap above 0: gaps of 0 (events of one read) sit on its left edge.
    const positive = series.flatMap((s) => s.points.map((p) => p[0]).filter((v) => v > 0));
    const xmin = positive.length ? Math.min(...positive) : undefined;
    Charts.lines(chart(`${name}-cdf`), series, { xlog: true, xmin, xfmt: axisMs, yfmt: (v) => `${Math.round(v * 100)}%`, ymax: 1, empty: "no completed requests" });
    const sameRead = $(`#${name}-same-read`);
    if (sameRead) {
      sameRead.textContent = runs.filter((run) => run.cdf[name].same_read > 0).map((run) =>
        `${run.name}: ${+(run.cdf[name].same_read * 100).toPrecision(2)}% of the client's gaps are 0: events that arrived in one read, ` +
        "which the client times once (it reads the clock once per read); they are drawn at the left edge.").join(" ");
    }
    const notes = runs.map((run) => {
      const a = run.cdf[name].agreement;
      if (!a) return `${run.name}: no proxy figures to compare with (not run through the proxy, or it was not scraped).`;
      if (a.at === null) return `${run.name}: client and proxy agree at every bucket edge.`;
      const side = a.gap > 0 ? "client has more" : "proxy has more";
      return `${run.name}: largest difference at ≤ ${axisMs(a.at)}: client ${Math.round(a.client * 100)}%, proxy ${Math.round(a.proxy * 100)}% (${side} below that edge).`;
    });
    const note = $(`#${name}-agreement`);
    note.textContent = notes.join(" ");
    runs.forEach((run, k) => {
      const a = run.cdf[name].agreement;
      if (a && Math.abs(a.gap) > 0.1) note.classList.add("flag");
      void k;
    });
  }

  function prefill() {
    const series = [], notes = [];
    runs.forEach((run, k) => {
      for (const [group, cls] of [["uncached", k ? "s1" : "s0"], ["cached", k ? "s4" : "s3"]]) {
        const g = run.prefill[group];
        if (!g.points.length) continue;
        series.push({ name: named(run, group === "cached" ? "half or more cached" : "mostly uncached"), cls, dots: true, r: 2.5, points: g.points });
        if (g.fit) {
          const f = g.fit;
          series.push({ name: "", cls: cls + " dash", points: [[f.x0, f.intercept + f.slope * f.x0], [f.x1, f.intercept + f.slope * f.x1]] });
          notes.push(`${run.name}, ${group}: +${(f.slope * 1e6).toFixed(1)} ms per 1000 prompt tokens`);
        }
      }
    });
    Charts.lines(chart("prefill"), series, { xfmt: (v) => `${Math.round(v)}`, yfmt: axisMs, xlabel: "prompt tokens", empty: "no completed request with a prompt token count" });
    $("#prefill-note").textContent = notes.length ? notes.join("; ") + "." : "All prompts had the same length: vary it with --prompt-tokens-max to see the slope.";
  }

  function decode() {
    const edges = data.decode_bins;
    const labels = [...edges.map((e, i) => `${i ? edges[i - 1] : 0}–${e}`), `> ${edges[edges.length - 1]}`];
    const slow = edges.indexOf(data.reading_pace), fast = edges.indexOf(data.fast);
    const bands = [
      { from: 0, to: slow, cls: "slow", label: "< 5 tok/s: slower than reading" },
      { from: slow + 1, to: fast, cls: "mid", label: "5–20" },
      { from: fast + 1, to: labels.length - 1, cls: "fast", label: "> 20 tok/s" },
    ];
    const series = runs.map((run, k) => {
      const total = run.decode.reduce((a, v) => a + v, 0);
      return { name: run.name, cls: CLIENT[k], values: total ? run.decode.map((v) => v / total) : null };
    });
    Charts.bars(chart("decode"), labels, series, { yfmt: (v) => `${Math.round(v * 100)}%`, bands, xlabel: "tokens/s", empty: "no request with two or more output tokens" });
  }

  function versus() {
    const table = $("#versus");
    table.appendChild(row(["", "count", "p50 ms", "p90 ms", "p99 ms", "mean ms"], "th"));
    runs.forEach((run) => {
      if (runs.length > 1) table.appendChild(row([run.name, "", "", "", "", ""], "th"));
      for (const [label, key] of [["TTFT", "ttft"], ["ITL", "itl"]]) {
        const client = run.table.find((cells) => cells[0] === label);
        if (client) table.appendChild(row([`${label} client`, client[1], client[3], client[4], client[5], client[2]]));
        const p = run.proxy[key];
        if (p) table.appendChild(row([`${label} proxy`, String(p.count), ms(p.p50), ms(p.p90), ms(p.p99), ms(p.mean)]));
      }
    });
  }

  function errors() {
    const table = $("#errors");
    table.appendChild(row(["", "kind", "requests"], "th"));
    const sent = [];
    runs.forEach((run) => {
      const kinds = Object.entries(run.errors);
      const failed = kinds.reduce((sum, [, v]) => sum + v, 0);
      sent.push(`${run.name}: ${run.requests} requests sent, ${failed || "none"} failed on the client side.`);
      if (!kinds.length) table.appendChild(row([run.name, "client: errors", "none"]));
      kinds.forEach(([k, v], i) => table.appendChild(row([i ? "" : run.name, `client: ${k}`, String(v)], "td", (td, c) => { if (c === 1) td.className = "bad"; })));
      for (const [k, v] of Object.entries(run.outcomes)) table.appendChild(row(["", `proxy outcome: ${k}`, String(v)]));
    });
    $("#errors-note").textContent = sent.join(" ");
  }

  function replay() {
    const shown = runs.filter((run) => run.replay);
    if (!shown.length) return;
    const host = $("#replay");
    shown.forEach((run) => {
      const title = document.createElement("p");
      title.className = "headline";
      title.textContent = named(run, run.replay.headline);
      const table = document.createElement("table");
      table.dataset.replay = run.name;
      run.replay.rows.forEach((cells, r) => {
        const heading = r === 0 || (cells[1] === "" && cells[2] === "");
        table.appendChild(row(cells, heading ? "th" : "td"));
      });
      const lines = document.createElement("pre");
      lines.className = "note";
      lines.textContent = run.replay.notes.join("\n");
      host.append(title, table, lines);
    });
    $("#replay-card").hidden = false;
  }

  function settings() {
    const keys = [...new Set(runs.flatMap((r) => Object.keys(r.settings)))];
    const table = $("#settings");
    table.appendChild(row(["", ...runs.map((r) => r.name)], "th"));
    for (const k of keys) table.appendChild(row([k, ...runs.map((r) => (r.settings[k] === undefined ? "–" : String(r.settings[k])))]));
  }

  const first = runs[0].settings;
  $("#subtitle").textContent = `${first.base_url || ""} · ${first.api || "chat"} · model ${first.model || "?"}` + (runs.length > 1 ? ` · compared with ${runs[1].name}` : "");
  replay(); tables(); cdf("ttft"); cdf("itl"); prefill(); decode(); versus(); errors(); settings();
  document.body.dataset.ready = "1";
})();
