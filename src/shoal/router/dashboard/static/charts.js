// The dashboard's charts: one <canvas> per figure, drawn from the router's per-second samples
// (GET /dashboard/api/series) over the chosen range, with gaps where nothing was measured and the
// values under the pointer in the legend.
import { $, el, fmtClock, fmtNumber, fmtSeconds } from "./dom.js";

const COLORS = { blue: "#2f6fb7", green: "#1f9d55", red: "#d64545", orange: "#d98200" };
const CHARTS = {
  tokens: { unit: "rate", series: [["tokens_per_s", "tokens/s", COLORS.blue]] },
  requests: { unit: "rate", series: [["requests_per_s", "finished", COLORS.green],
                                     ["errors_per_s", "errors", COLORS.red]] },
  load: { unit: "count", series: [["in_flight", "in flight", COLORS.blue], ["queued", "queued", COLORS.orange]] },
  ttft: { unit: "s", series: [["ttft_p50_s", "p50", COLORS.blue], ["ttft_p90_s", "p90", COLORS.orange],
                              ["ttft_p99_s", "p99", COLORS.red]] },
  itl: { unit: "s", series: [["itl_p50_s", "p50", COLORS.blue], ["itl_p90_s", "p90", COLORS.orange],
                             ["itl_p99_s", "p99", COLORS.red]] },
  e2e: { unit: "s", series: [["e2e_p50_s", "p50", COLORS.blue], ["e2e_p90_s", "p90", COLORS.orange],
                             ["e2e_p99_s", "p99", COLORS.red]] },
};

// The samples to draw (set by the page) and where the pointer is on each chart.
export const chartState = { samples: [], intervalS: 1, windowS: null, hover: {} };

function niceStep(x) {
  const power = 10 ** Math.floor(Math.log10(x));
  for (const step of [1, 2, 2.5, 5]) if (x <= step * power) return step * power;
  return 10 * power;
}

function formatValue(unit, value) {
  if (value === null || value === undefined) return "–";
  const text = unit === "s" ? fmtSeconds(value) : fmtNumber(value, value < 10 ? 1 : 0);
  return text.replace(/\.0+(?= |$)/, "");
}

function drawChart(figure) {
  const spec = CHARTS[figure.dataset.chart];
  const canvas = figure.querySelector("canvas");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (!width || !height) return;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const range = Number($("#range").value);
  const end = chartState.samples.length ? chartState.samples[chartState.samples.length - 1].time : Date.now() / 1000;
  const start = end - range;
  const visible = chartState.samples.filter((s) => s.time >= start);
  const values = visible.flatMap((s) => spec.series.map(([key]) => s[key])).filter((v) => v !== null && v !== undefined);
  const highest = Math.max(...values, spec.unit === "s" ? 0.004 : 4);
  const step = niceStep(highest / 4);
  const ticks = Math.max(1, Math.ceil(highest / step - 1e-9));
  const top = step * ticks;
  const left = 52, right = 8, upper = 6, lower = 18;
  const plotW = width - left - right, plotH = height - upper - lower;
  const x = (t) => left + ((t - start) / range) * plotW;
  const y = (v) => upper + plotH - (v / top) * plotH;
  g.font = "10px system-ui, sans-serif";
  g.fillStyle = "#6b7785";
  g.strokeStyle = "#e3e8ee";
  g.lineWidth = 1;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (let i = 0; i <= ticks; i += 1) {
    const value = step * i;
    const py = Math.round(y(value)) + 0.5;
    g.beginPath();
    g.moveTo(left, py);
    g.lineTo(width - right, py);
    g.stroke();
    g.fillText(formatValue(spec.unit, value), left - 6, py);
  }
  g.textBaseline = "top";
  for (const fraction of [0, 0.5, 1]) {
    const t = start + fraction * range;
    g.textAlign = fraction === 0 ? "left" : fraction === 1 ? "right" : "center";
    g.fillText(fraction === 1 ? "now" : `-${Math.round((1 - fraction) * range / 60 * 10) / 10} min`,
               x(t), upper + plotH + 4);
  }
  for (const [key, , color] of spec.series) {
    g.strokeStyle = color;
    g.fillStyle = color;
    g.lineWidth = 1.6;
    g.beginPath();
    let drawing = false, previous = null;
    for (const sample of visible) {
      const value = sample[key];
      const gap = previous !== null && sample.time - previous > 3 * (chartState.intervalS || 1);
      if (value === null || value === undefined || gap) { drawing = false; }
      if (value === null || value === undefined) { previous = sample.time; continue; }
      if (drawing) g.lineTo(x(sample.time), y(value)); else g.moveTo(x(sample.time), y(value));
      if (!drawing) g.fillRect(x(sample.time) - 1, y(value) - 1, 2, 2);
      drawing = true;
      previous = sample.time;
    }
    g.stroke();
  }
  const hover = chartState.hover[figure.dataset.chart];
  let shown = visible[visible.length - 1];
  if (hover !== undefined && visible.length) {
    shown = visible.reduce((best, s) => (Math.abs(s.time - hover) < Math.abs(best.time - hover) ? s : best));
    g.strokeStyle = "#9aa6b2";
    g.lineWidth = 1;
    g.beginPath();
    g.moveTo(Math.round(x(shown.time)) + 0.5, upper);
    g.lineTo(Math.round(x(shown.time)) + 0.5, upper + plotH);
    g.stroke();
  }
  const legend = figure.querySelector(".legend");
  legend.replaceChildren(...spec.series.map(([key, label, color]) => {
    const swatch = el("i");
    swatch.style.setProperty("--c", color);
    return el("span", {}, swatch, `${label} `, el("b", { text: shown ? formatValue(spec.unit, shown[key]) : "–" }));
  }), hover !== undefined && shown ? el("span", { text: fmtClock(shown.time) }) : "");
}

export function drawCharts() {
  document.querySelectorAll(".chart").forEach(drawChart);
  if (chartState.windowS) $("#charts-note").textContent = `latencies: percentiles over the last ${chartState.windowS} s`;
}

export function watchChartHover() {
  document.querySelectorAll(".chart").forEach((figure) => {
    const canvas = figure.querySelector("canvas");
    canvas.addEventListener("mousemove", (event) => {
      const box = canvas.getBoundingClientRect();
      const range = Number($("#range").value);
      const end = chartState.samples.length ? chartState.samples[chartState.samples.length - 1].time : Date.now() / 1000;
      chartState.hover[figure.dataset.chart] = end - range + ((event.clientX - box.left - 52) / (box.width - 60)) * range;
      drawChart(figure);
    });
    canvas.addEventListener("mouseleave", () => {
      delete chartState.hover[figure.dataset.chart];
      drawChart(figure);
    });
  });
}
