// Small helpers shared by the dashboard's modules: building DOM nodes (values always as text) and
// formatting numbers, durations, times and worker names.

export const $ = (selector) => document.querySelector(selector);

export function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

export const fmtClock = (epochS) => new Date(epochS * 1000).toLocaleTimeString([], { hour12: false });
export function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s === 0) return "0";
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : s < 0.1 ? 1 : 0)} ms`;
  if (s < 120) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  return `${(s / 60).toFixed(1)} min`;
}
export function fmtNumber(x, digits = 1) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x) >= 1000) return `${(x / 1000).toFixed(1)}k`;
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}
export function fmtAgo(epochS) {
  const s = Math.max(0, Date.now() / 1000 - epochS);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}
export const shortWorker = (id) => (id || "").replace(/^https?:\/\//, "");
export const processName = (span) => (span.service === "shoal-router" ? "router"
  : shortWorker(span.instance || span.service || ""));
