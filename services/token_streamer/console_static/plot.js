"use strict";
// Small SVG line plots for the Tophat console, no library: TophatPlot.draw(svg, series, options).
// series: [{name, points: [[x, y], ...]}]; options: {time: now (x is unix s, shown as seconds ago),
// yLabels: [names] (y is an index into them), step: true (hold each value to the next point), unit}.
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#2f6fde", "#e67e22", "#1e8e3e", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400"];
  const M = { l: 44, r: 8, t: 10, b: 20 };

  function el(name, attrs, parent, text) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a >= 100 || v === 0) return String(Math.round(v));
    return a >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  function draw(svg, series, options) {
    const o = options || {};
    const W = svg.clientWidth || 400, H = svg.clientHeight || 160;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && Number.isFinite(p[1])));
    svg.dataset.points = String(all.length);
    if (!all.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, svg, "no data yet");
      return;
    }
    let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
    if (o.time !== undefined) x1 = Math.max(x1, o.time);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    const labels = o.yLabels;
    const yMax = labels ? Math.max(labels.length - 1, 1) : Math.max(...all.map((p) => p[1])) * 1.1 || 1;
    const sx = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
    const sy = (y) => H - M.b - (y / yMax) * (H - M.t - M.b);
    el("line", { class: "axis", x1: M.l, y1: H - M.b, x2: W - M.r, y2: H - M.b }, svg);
    el("line", { class: "axis", x1: M.l, y1: M.t, x2: M.l, y2: H - M.b }, svg);
    const yTicks = labels ? labels.map((_, i) => i) : [0, yMax / 2, yMax];
    for (const y of yTicks) {
      el("text", { x: M.l - 4, y: sy(y) + 3, "text-anchor": "end" }, svg, labels ? labels[y] : fmt(y));
    }
    for (const x of [x0, (x0 + x1) / 2, x1]) {
      const ago = Math.round(o.time - x);
      const text = o.time === undefined ? fmt(x) : ago > 0 ? `-${ago} s` : "now";
      el("text", { x: sx(x), y: H - 5, "text-anchor": "middle" }, svg, text);
    }
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      const pts = s.points.filter((p) => p[1] !== null && Number.isFinite(p[1]));
      if (!pts.length) return;
      const path = [];
      pts.forEach((p, k) => {
        if (o.step && k > 0) path.push(`${sx(p[0])},${sy(pts[k - 1][1])}`);
        path.push(`${sx(p[0])},${sy(p[1])}`);
      });
      if (o.step && o.time !== undefined) path.push(`${sx(x1)},${sy(pts[pts.length - 1][1])}`);
      el("polyline", { points: path.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }, svg);
      if (!o.step) for (const p of pts) el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: color }, svg);
      el("text", { x: W - M.r - 4, y: M.t + 10 + 12 * i, "text-anchor": "end", style: `fill:${color}` }, svg, s.name);
    });
  }

  window.TophatPlot = { draw };
})();
