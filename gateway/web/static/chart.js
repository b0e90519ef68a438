// A stacked bar chart drawn as inline SVG: one bar per time bucket, one colour per series.
import { el, fmt } from "./common.js";

const W = 800, H = 240, LEFT = 48, BOTTOM = 22, TOP = 8, RIGHT = 8;

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

/**
 * buckets: sorted start times; series: [{name, values: Map(start -> value)}]; the chart's figures
 * also go on the svg as data attributes and in its label, for screen readers and tests.
 */
export function stackedBars({ buckets, bucket, series, unit, digits = 0, label }) {
  const totals = buckets.map((b) => series.reduce((s, x) => s + (x.values.get(b) || 0), 0));
  // Counts get whole-number ticks (4 gridlines over at least 4); amounts may have fractions.
  const max = Math.max(niceMax(Math.max(0, ...totals)), digits ? 0 : 4);
  const plotW = W - LEFT - RIGHT, plotH = H - TOP - BOTTOM;
  const step = plotW / Math.max(1, buckets.length);
  const y = (v) => TOP + plotH - (v / max) * plotH;
  const sum = totals.reduce((a, b) => a + b, 0);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${label}: ${fmt(sum, digits)} ${unit} in all`, "data-total": sum });
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    svg.append(el("line", { class: "axis", x1: LEFT, x2: W - RIGHT, y1: y(v), y2: y(v) }));
    svg.append(el("text", { x: LEFT - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v, digits ? Math.min(digits, 4) : Number.isInteger(v) ? 0 : 1)));
  }
  const every = Math.max(1, Math.ceil(buckets.length / 8));
  buckets.forEach((b, i) => {
    let base = 0;
    const x = LEFT + i * step + step * 0.1;
    series.forEach((s, k) => {
      const v = s.values.get(b) || 0;
      if (v <= 0) return;
      const rect = el("rect", { class: `s${k % 8}`, x, width: Math.max(1, step * 0.8), y: y(base + v), height: Math.max(1, y(base) - y(base + v)), "data-series": s.name, "data-value": v },
        el("title", {}, `${new Date(b * 1000).toLocaleString()} · ${s.name}: ${fmt(v, digits)} ${unit}`));
      svg.append(rect);
      base += v;
    });
    if (i % every === 0) {
      const t = new Date(b * 1000);
      const text = bucket >= 86400 ? t.toLocaleDateString() : bucket >= 3600 ? `${t.getMonth() + 1}/${t.getDate()} ${t.getHours()}h` : t.toTimeString().slice(0, 5);
      svg.append(el("text", { x: LEFT + i * step + step / 2, y: H - 6, "text-anchor": "middle" }, text));
    }
  });
  return svg;
}
