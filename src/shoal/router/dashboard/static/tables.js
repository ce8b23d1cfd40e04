// The dashboard's tables: the summary bar, the workers, the recent requests and the event feed.
import { $, el, fmtAgo, fmtClock, fmtNumber, fmtSeconds, shortWorker } from "./dom.js";

const GOOD_CHANGES = new Set(["up", "registered", "rejoined", "breaker_closed"]);
export const MAX_EVENTS = 300;

export function renderSummary(cluster) {
  const latest = cluster.latest || {};
  const serving = cluster.workers.filter((w) => w.status === "healthy").length;
  const present = cluster.workers.filter((w) => w.url && !["gone", "restarting", "starting", "spare"]
    .includes(w.status)).length;
  const queued = Object.values(cluster.queued || {}).reduce((a, b) => a + b, 0);
  const items = [["Workers healthy", `${serving} / ${present}`], ["Models", cluster.models.join(", ") || "–"],
                 ["In flight", fmtNumber(cluster.in_flight)], ["Queued", fmtNumber(queued)],
                 ["Requests/s", fmtNumber(latest.requests_per_s)], ["Tokens/s", fmtNumber(latest.tokens_per_s, 0)],
                 ["TTFT p50", fmtSeconds(latest.ttft_p50_s)], ["ITL p50", fmtSeconds(latest.itl_p50_s)]];
  $("#summary").replaceChildren(...items.map(([name, value]) => el("div", {}, el("dt", { text: name }),
                                                                  el("dd", { text: value }))));
}

function statusLabel(worker) {
  const labels = { healthy: "healthy", down: "down", ejected: "ejected", breaker_open: "breaker open",
                   half_open: "probing", draining: "draining", gone: "gone", starting: "starting",
                   restarting: "restarting", spare: "warm spare" };
  return labels[worker.status] || worker.status;
}

function kvCell(worker) {
  const usage = worker.kv_cache_usage;
  if (usage === null || usage === undefined) return el("span", { class: "small", text: "–" });
  const fill = el("span", { class: usage > 0.95 ? "full" : usage > 0.8 ? "high" : "" });
  fill.style.width = `${Math.min(100, Math.max(0, usage * 100)).toFixed(1)}%`;
  const title = worker.kv_capacity_tokens ? `${worker.free_kv_tokens} of ${worker.kv_capacity_tokens} tokens free`
    : "";
  return el("div", { class: "kv", title }, el("div", { class: "bar" }, fill),
            el("span", { class: "pct", text: `${(usage * 100).toFixed(0)}%` }));
}

function speculationLine(worker) {
  const perStep = worker.decode_tokens_per_step;
  if (worker.drafts_kept === null || worker.drafts_kept === undefined) return null;
  const text = `speculating: ${(worker.drafts_kept * 100).toFixed(0)}% of drafts kept`
    + (perStep ? ` · ${perStep.toFixed(2)} tokens/step` : "");
  return el("div", { class: "small speculation", text });
}

function workerDetails(worker) {
  const parts = [];
  const replica = worker.replica;
  if (replica) {
    parts.push(`slot ${replica.slot}`);
    if (replica.pid) parts.push(`pid ${replica.pid}`);
    if (replica.restarts) parts.push(`${replica.restarts} restart${replica.restarts > 1 ? "s" : ""}`);
    if (replica.last_exit !== null && replica.last_exit !== undefined) parts.push(`last exit ${replica.last_exit}`);
    if (replica.node) parts.push(`node ${replica.node}`);
  }
  if (worker.load_source && worker.load_source !== "shoal") parts.push(`load from ${worker.load_source}`);
  if (worker.gone_since) parts.push(`left ${fmtAgo(worker.gone_since)}`);
  else if (worker.last_contact_s > 3) parts.push(`silent ${fmtSeconds(worker.last_contact_s)}`);
  return parts.join(" · ");
}

export function renderWorkers(workers) {
  const rows = workers.map((worker) => {
    const event = worker.last_event;
    const decode = worker.decode_tokens_per_s;
    const live = worker.status !== "gone";
    return el("tr", { "data-worker-id": worker.worker_id, "data-status": worker.status,
                      class: worker.status === "gone" ? "gone" : "" },
      el("td", {}, el("span", { class: "status", "data-status": worker.status, text: statusLabel(worker) }),
         worker.breaker && worker.breaker !== "closed" && worker.status !== "breaker_open"
           ? el("span", { class: "tag", text: `breaker ${worker.breaker}` }) : null),
      el("td", {}, el("div", { class: "mono", text: shortWorker(worker.url || worker.worker_id) }),
         el("div", { class: "small", text: workerDetails(worker) })),
      el("td", { text: (worker.models || []).join(", ") }),
      el("td", { class: "num", text: `${worker.running ?? 0} · ${worker.waiting ?? 0} · ${worker.in_flight ?? 0}` }),
      el("td", {}, live ? kvCell(worker) : "–"),
      el("td", { class: "num" }, el("div", { text: live ? fmtNumber(worker.relayed_tokens_per_s, 1) : "–" }),
         live && decode ? el("div", { class: "small", text: `decode ${fmtNumber(decode, 0)}/s` }) : null,
         live ? speculationLine(worker) : null),
      el("td", { class: "num", text: `${fmtSeconds(worker.ttft_s)} · ${fmtSeconds(worker.itl_s)}` }),
      el("td", { class: "small" }, event ? `${event.change}${event.reason ? `: ${event.reason}` : ""} · `
                                          + fmtAgo(event.time) : ""));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 8, class: "empty", text: "No workers yet." })));
  $("#workers tbody").replaceChildren(...rows);
  const gone = workers.filter((w) => w.status === "gone").length;
  $("#workers-note").textContent = gone ? `${gone} left the router lately (kept a few minutes)` : "";
}

// --- recent requests ------------------------------------------------------------------------

export function renderRequests(requests, selected, open) {
  const rows = requests.map((request) => {
    const status = request.status ?? (request.ok ? "ok" : "error");
    const extra = [request.retries ? `${request.retries} retried` : "", request.migrations
      ? `${request.migrations} migrated` : ""].filter(Boolean).join(", ");
    return el("tr", { "data-trace-id": request.trace_id, class: request.trace_id === selected ? "selected" : "",
                      onclick: () => open(request.trace_id) },
      el("td", { text: fmtClock(request.time) }),
      el("td", { text: request.model || "–" }),
      el("td", {}, el("span", { class: request.ok ? "ok" : "err", text: String(status) }),
         request.stream ? el("span", { class: "small", text: " stream" }) : null),
      el("td", { class: "num", text: fmtSeconds(request.ttft_s) }),
      el("td", { class: "num", text: fmtSeconds(request.duration_s) }),
      el("td", { class: "num", text: fmtNumber(request.output_tokens) }),
      el("td", { class: "num" }, String(request.attempts ?? "–"), extra ? el("span", { class: "tag", text: extra }) : null),
      el("td", { class: "mono small", text: shortWorker(request.workers[request.workers.length - 1]) }));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 8, class: "empty", text: "No request yet." })));
  $("#requests tbody").replaceChildren(...rows);
}

// --- the event feed -----------------------------------------------------------------------

function describeEvent(event) {
  const details = [];
  if (event.model && event.kind !== "health") details.push(event.model);
  if (event.tokens !== undefined) details.push(`after ${event.tokens} tokens`);
  if (event.exit_code !== undefined && event.exit_code !== null) details.push(`exit ${event.exit_code}`);
  return details;
}

export function renderEvents(events) {
  const items = events.slice(-MAX_EVENTS).reverse().map((event) => el("li",
    { "data-kind": event.kind, "data-change": event.change, "data-worker-id": event.worker_id || "" },
    el("time", { text: fmtClock(event.time), title: new Date(event.time * 1000).toString() }),
    el("span", { class: "kind", "data-kind": event.kind, "data-good": GOOD_CHANGES.has(event.change),
                 text: event.kind }),
    el("span", { class: "what" }, el("b", { text: event.change.replaceAll("_", " ") }),
       event.worker_id ? el("span", { class: "mono", text: ` ${shortWorker(event.worker_id)}` }) : null,
       describeEvent(event).length ? ` (${describeEvent(event).join(", ")})` : "",
       event.reason ? el("span", { class: "reason", text: ` — ${event.reason}` }) : null)));
  if (!items.length) items.push(el("li", { class: "empty", text: "Nothing has happened yet." }));
  $("#events").replaceChildren(...items);
}
