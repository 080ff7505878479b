// Small SVG charts for the live page and the bench report: lines (over time, CDFs),
// bars (histograms with shaded bands), stacked bars, scatter. No library: each chart
// is a fixed viewBox that scales with its box; colours come from CSS classes.
"use strict";
const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 600, H = 230, L = 52, R = 22, T = 26, B = 34;

  function el(tag, attrs, parent, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function frame(host, height) {
    host.replaceChildren();
    return el("svg", { viewBox: `0 0 ${W} ${height || H}`, role: "img" }, host);
  }

  function empty(host, message) {
    const svg = frame(host, 80);
    el("text", { x: W / 2, y: 45, class: "empty", "text-anchor": "middle" }, svg,
      message || "no data yet");
    host.dataset.drawn = "empty";
  }

  // A round upper bound and its ticks for values up to max.
  function niceTicks(max, count) {
    if (!(max > 0)) max = 1;
    const raw = max / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const ticks = [];
    for (let v = 0; v <= max + step * 1e-9; v += step) ticks.push(v);
    if (ticks[ticks.length - 1] < max) ticks.push(ticks[ticks.length - 1] + step);
    return ticks;
  }

  function logTicks(lo, hi) {
    const out = [];
    const mults = Math.log10(hi / lo) > 2.5 ? [1] : [1, 2, 5];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      for (const m of mults) {
        const v = m * Math.pow(10, e);
        if (v >= lo && v <= hi) out.push(v);
      }
    }
    return out;
  }

  function scale(d0, d1, r0, r1, log) {
    if (log) {
      const a = Math.log(d0), b = Math.log(d1);
      return (v) => r0 + ((Math.log(Math.max(v, d0)) - a) / (b - a || 1)) * (r1 - r0);
    }
    return (v) => r0 + ((v - d0) / (d1 - d0 || 1)) * (r1 - r0);
  }

  // One row of keys above the plot; names are cut to fit rather than overlap.
  function legend(svg, items) {
    const room = (W - L - R) / Math.max(items.length, 1);
    items.forEach((item, i) => {
      const x = L + i * room, chars = Math.floor((room - 22) / 6);
      const name = item.name.length > chars ? item.name.slice(0, Math.max(chars - 1, 1)) + "…" : item.name;
      el("rect", { x, y: 6, width: 12, height: 10, class: `key ${item.cls}` }, svg);
      el("text", { x: x + 16, y: 15, class: "legend" }, svg, name);
    });
  }

  function linearTicks(x0, x1) {
    const step = niceTicks(x1 - x0, 5)[1];
    const out = [];
    for (let v = Math.ceil(x0 / step) * step; v <= x1 + step * 1e-9; v += step) out.push(v);
    return out;
  }

  function yAxis(svg, ticks, y, fmt, x0, x1) {
    for (const v of ticks) {
      el("line", { x1: x0, x2: x1, y1: y(v), y2: y(v), class: "grid" }, svg);
      el("text", { x: x0 - 6, y: y(v) + 4, class: "ax", "text-anchor": "end" }, svg, fmt(v));
    }
  }

  // series: [{name, cls, points: [[x, y] | null, ...], dots?: bool, step?: bool}]
  // opts: {xfmt, yfmt, xlog, xlabel, marks: [{x, label, cls}], xmin, xmax, ymax}
  function lines(host, series, opts) {
    opts = opts || {};
    const pts = series.flatMap((s) => s.points.filter((p) => p && isFinite(p[0]) && isFinite(p[1])));
    if (!pts.length) return empty(host, opts.empty);
    const svg = frame(host);
    let x0 = opts.xmin !== undefined ? opts.xmin : Math.min(...pts.map((p) => p[0]));
    let x1 = opts.xmax !== undefined ? opts.xmax : Math.max(...pts.map((p) => p[0]));
    if (opts.xlog) { x0 = Math.max(x0, 1e-6); x1 = Math.max(x1, x0 * 10); }
    if (x1 === x0) x1 = x0 + 1;
    const yt = niceTicks(opts.ymax || Math.max(...pts.map((p) => p[1])), 4);
    const x = scale(x0, x1, L, W - R, opts.xlog);
    const y = scale(0, yt[yt.length - 1], H - B, T, false);
    yAxis(svg, yt, y, opts.yfmt || String, L, W - R);
    const xt = opts.xlog ? logTicks(x0, x1) : linearTicks(x0, x1);
    for (const v of xt) {
      el("text", { x: x(v), y: H - B + 16, class: "ax", "text-anchor": "middle" }, svg, (opts.xfmt || String)(v));
    }
    if (opts.xlabel) el("text", { x: W - R, y: H - 4, class: "ax", "text-anchor": "end" }, svg, opts.xlabel);
    for (const m of opts.marks || []) {
      if (!(m.x >= x0 && m.x <= x1)) continue;
      el("line", { x1: x(m.x), x2: x(m.x), y1: T, y2: H - B, class: `mark ${m.cls || ""}` }, svg);
      el("text", { x: x(m.x) + 3, y: T + 10, class: "ax" }, svg, m.label);
    }
    series.forEach((s) => {
      const g = el("g", { class: `series ${s.cls}`, "data-name": s.name }, svg);
      if (s.dots) {
        for (const p of s.points) {
          if (p && isFinite(p[1])) el("circle", { cx: x(p[0]), cy: y(p[1]), r: s.r || 3.5 }, g);
        }
        return;
      }
      let d = "", pen = "M";
      let prev = null;
      for (const p of s.points) {
        if (!p || !isFinite(p[1]) || !isFinite(p[0])) { pen = "M"; prev = null; continue; }
        if (s.step && prev) d += `H${x(p[0]).toFixed(1)}`;
        d += `${pen}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`;
        pen = "L"; prev = p;
      }
      el("path", { d, class: "line" }, g);
    });
    legend(svg, series.filter((s) => s.name));
    host.dataset.drawn = "chart";
  }

  // labels: one per bucket; series: [{name, cls, values}] (values may be null);
  // bands: [{from, to, cls, label}] bucket index ranges shaded behind the bars.
  function bars(host, labels, series, opts) {
    opts = opts || {};
    const live = series.filter((s) => s.values && s.values.some((v) => v > 0));
    if (!live.length) return empty(host, opts.empty);
    const svg = frame(host);
    const n = labels.length;
    const yt = niceTicks(Math.max(...live.flatMap((s) => s.values)), 4);
    const y = scale(0, yt[yt.length - 1], H - B, T, false);
    const slot = (W - L - R) / n;
    for (const b of opts.bands || []) {
      const bx = L + b.from * slot;
      el("rect", { x: bx, y: T, width: (b.to - b.from + 1) * slot, height: H - B - T, class: `band ${b.cls}` }, svg);
      el("text", { x: bx + 4, y: T + 12, class: "ax band-label" }, svg, b.label);
    }
    yAxis(svg, yt, y, opts.yfmt || String, L, W - R);
    const width = (slot * 0.8) / live.length;
    live.forEach((s, k) => {
      const g = el("g", { class: `series ${s.cls}`, "data-name": s.name }, svg);
      s.values.forEach((v, i) => {
        if (!(v > 0)) return;
        const bx = L + i * slot + slot * 0.1 + k * width;
        const r = el("rect", { x: bx, y: y(v), width: Math.max(width - 1, 1), height: H - B - y(v), class: "bar" }, g);
        el("title", {}, r, `${labels[i]}: ${(opts.yfmt || String)(v)}`);
      });
    });
    const every = Math.ceil(n / 12);
    labels.forEach((label, i) => {
      if (i % every) return;
      el("text", { x: L + i * slot + slot / 2, y: H - B + 16, class: "ax", "text-anchor": "middle" }, svg, label);
    });
    if (opts.xlabel) el("text", { x: W - R, y: H - 4, class: "ax", "text-anchor": "end" }, svg, opts.xlabel);
    legend(svg, live.filter((s) => s.name));
    host.dataset.drawn = "chart";
  }

  // rows: [{label, parts: [{name, value, cls}]}]: one horizontal bar per row, parts as
  // shares of the row's total, each labelled with its share.
  function stack(host, rows, opts) {
    opts = opts || {};
    const live = rows.filter((r) => r.parts.some((p) => p.value > 0));
    if (!live.length) return empty(host, opts.empty);
    const height = T + live.length * 50 + 4;
    const svg = frame(host, height);
    const left = L, right = W - R;
    live.forEach((row, i) => {
      const total = row.parts.reduce((a, p) => a + Math.max(p.value, 0), 0);
      const top = T + i * 50;
      el("text", { x: left, y: top + 12, class: "ax" }, svg, row.label);
      let at = left;
      for (const p of row.parts) {
        const w = (Math.max(p.value, 0) / total) * (right - left);
        if (w <= 0) continue;
        const r = el("rect", { x: at, y: top + 17, width: w, height: 26, class: `seg ${p.cls}`, "data-name": p.name }, svg);
        el("title", {}, r, `${p.name}: ${(opts.fmt || String)(p.value)}`);
        if (w > 34) {
          el("text", { x: at + w / 2, y: top + 35, class: "seg-label", "text-anchor": "middle" }, svg,
            `${Math.round((100 * p.value) / total)}%`);
        }
        at += w;
      }
    });
    legend(svg, live[0].parts.map((p) => ({ name: p.name, cls: p.cls })));
    host.dataset.drawn = "chart";
  }

  return { lines, bars, stack, el, empty };
})();
