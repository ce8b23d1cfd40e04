// One request's spans as a waterfall: a bar per span positioned by its start and end, indented under
// its parent, the span's events as marks; attributes on hover, all of them on click.
import { $, el, fmtSeconds, processName } from "./dom.js";

function orderSpans(spans) {
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const children = new Map();
  const roots = [];
  for (const span of spans) {
    if (span.parent_span_id && byId.has(span.parent_span_id)) {
      if (!children.has(span.parent_span_id)) children.set(span.parent_span_id, []);
      children.get(span.parent_span_id).push(span);
    } else roots.push(span);
  }
  const ordered = [];
  const visit = (span, depth) => {
    ordered.push([span, depth]);
    for (const child of (children.get(span.span_id) || []).sort((a, b) => a.start_ns - b.start_ns)) {
      visit(child, depth + 1);
    }
  };
  roots.sort((a, b) => a.start_ns - b.start_ns).forEach((root) => visit(root, 0));
  return ordered;
}

function showTooltip(event, span) {
  const tip = $("#tooltip");
  const attributes = Object.entries(span.attributes || {}).slice(0, 14);
  tip.replaceChildren(el("div", {}, el("b", { text: span.name }), ` ${fmtSeconds((span.end_ns - span.start_ns) / 1e9)}`),
                      el("div", { text: processName(span) }),
                      ...attributes.map(([k, v]) => el("div", { text: `${k}: ${v}` })),
                      ...(span.events || []).map((e) => el("div", { text: `event ${e.name}` })));
  tip.hidden = false;
  tip.style.left = `${Math.min(event.clientX + 14, window.innerWidth - 440)}px`;
  tip.style.top = `${event.clientY + 14}px`;
}

function showSpanDetail(span, row) {
  document.querySelectorAll(".wf-row.selected").forEach((r) => r.classList.remove("selected"));
  row.classList.add("selected");
  const entries = [["span", `${span.name} (${span.kind}, ${span.status})`],
                   ["process", `${span.service || ""} ${span.instance || ""}`.trim()],
                   ["duration", fmtSeconds((span.end_ns - span.start_ns) / 1e9)], ["span id", span.span_id],
                   ...Object.entries(span.attributes || {}),
                   ...(span.events || []).map((e) => [`event ${e.name}`, JSON.stringify(e.attributes)])];
  const detail = $("#span-detail");
  detail.replaceChildren(el("h3", { text: span.name }),
                         el("table", {}, ...entries.map(([k, v]) => el("tr", {}, el("td", { text: k }),
                                                                        el("td", { text: String(v) })))));
  detail.hidden = false;
}

export function renderWaterfall(spans) {
  const box = $("#waterfall");
  $("#span-detail").hidden = true;
  if (!spans.length) {
    $("#waterfall-note").textContent = "";
    box.replaceChildren(el("span", { class: "empty", text: "No spans kept for this request." }));
    return;
  }
  const t0 = Math.min(...spans.map((s) => s.start_ns));
  const t1 = Math.max(...spans.map((s) => s.end_ns || s.start_ns));
  const total = Math.max(t1 - t0, 1);
  const services = new Set(spans.map(processName));
  $("#waterfall-note").textContent = `${spans.length} spans · ${fmtSeconds(total / 1e9)} · ${services.size} processes`;
  const ticks = el("div", { class: "wf-ticks" }, ...[0, 0.25, 0.5, 0.75, 1].map((f) => {
    const label = el("span", { text: fmtSeconds((f * total) / 1e9) });
    label.style.left = `${f * 100}%`;
    if (f === 1) label.style.transform = "translateX(-100%)";
    return label;
  }));
  const rows = orderSpans(spans).map(([span, depth]) => {
    const bar = el("div", { class: "wf-bar", "data-service": span.service, "data-error": span.status === "error" });
    bar.style.left = `${((span.start_ns - t0) / total) * 100}%`;
    bar.style.width = `${Math.max(((span.end_ns - span.start_ns) / total) * 100, 0.3)}%`;
    const marks = (span.events || []).map((e) => {
      const mark = el("div", { class: "wf-mark", title: e.name });
      mark.style.left = `${((e.time_ns - t0) / total) * 100}%`;
      return mark;
    });
    const name = el("div", { class: "wf-name" }, span.name, el("span", { class: "svc", text: processName(span) }));
    name.style.paddingLeft = `${depth * 14}px`;
    const row = el("div", { class: "wf-row", "data-span-name": span.name },
                   name, el("div", { class: "wf-track" }, bar, ...marks),
                   el("div", { class: "wf-dur", text: fmtSeconds((span.end_ns - span.start_ns) / 1e9) }));
    row.addEventListener("mousemove", (event) => showTooltip(event, span));
    row.addEventListener("mouseleave", () => { $("#tooltip").hidden = true; });
    row.addEventListener("click", () => showSpanDetail(span, row));
    return row;
  });
  box.replaceChildren(el("div", { class: "wf-axis" }, el("div", { text: "span" }), ticks, el("div")), ...rows);
}
