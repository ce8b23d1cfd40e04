// The shoal dashboard: signs in with the admin token (from the URL fragment, kept in sessionStorage,
// sent only as a bearer header), polls the router's /dashboard/api/* endpoints and redraws the
// summary, workers, charts, recent requests and event feed; a clicked request shows its spans.
import { chartState, drawCharts, watchChartHover } from "./charts.js";
import { $, fmtClock } from "./dom.js";
import { MAX_EVENTS, renderEvents, renderRequests, renderSummary, renderWorkers } from "./tables.js";
import { renderWaterfall } from "./waterfall.js";

const REFRESH_MS = 1500;
const MAX_SAMPLES = 600;
const TOKEN_KEY = "shoal.dashboard.token";
const REFUSED = "The admin token was not accepted (HTTP 401). Paste the right one:";

const state = { token: null, events: [], lastSeq: 0, selected: null, timer: null, polling: false };

// --- the token -------------------------------------------------------------------------------

function takeTokenFromFragment() {
  const match = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);  // out of the address bar
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

class AuthError extends Error {}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${state.token}` }, cache: "no-store" });
  if (response.status === 401 || response.status === 403) throw new AuthError(`HTTP ${response.status}`);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function setConnection(kind, text) {
  const badge = $("#connection");
  badge.dataset.state = kind;
  badge.textContent = text;
}

function askForToken(message) {
  clearTimeout(state.timer);
  state.token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("#main").hidden = true;
  $("#summary").replaceChildren();
  $("#sign-out").hidden = true;
  $("#auth").hidden = false;
  $("#auth-message").textContent = message;
  setConnection("error", "not signed in");
  $("#auth-token").focus();
}

// --- one request's spans ---------------------------------------------------------------------

async function openTrace(traceId) {
  state.selected = traceId;
  document.querySelectorAll("#requests tbody tr").forEach((row) => row.classList
    .toggle("selected", row.dataset.traceId === traceId));
  const panel = $("#waterfall-panel");
  panel.hidden = false;
  $("#waterfall-title").textContent = traceId;
  $("#waterfall-note").textContent = "loading…";
  try {
    const trace = await api(`/dashboard/api/requests/${encodeURIComponent(traceId)}`);
    if (state.selected !== traceId) return;
    renderWaterfall(trace.spans);
    panel.scrollIntoView({ block: "nearest", behavior: "smooth" });
  } catch (error) {
    if (error instanceof AuthError) askForToken(REFUSED);
    else $("#waterfall-note").textContent = `could not load the spans: ${error.message}`;
  }
}

function closeTrace() {
  state.selected = null;
  $("#waterfall-panel").hidden = true;
  document.querySelectorAll("#requests tbody tr.selected").forEach((row) => row.classList.remove("selected"));
}

// --- polling ---------------------------------------------------------------------------------

async function refresh() {
  const samples = chartState.samples;
  const after = samples.length ? `?after=${samples[samples.length - 1].time}` : "";
  const [cluster, events, series, requests] = await Promise.all([
    api("/dashboard/api/cluster"), api(`/dashboard/api/events?after=${state.lastSeq}&limit=${MAX_EVENTS}`),
    api(`/dashboard/api/series${after}`), api("/dashboard/api/requests?limit=50")]);
  $("#auth").hidden = true;
  $("#main").hidden = false;
  $("#sign-out").hidden = false;
  renderSummary(cluster);
  renderWorkers(cluster.workers);
  renderRequests(requests.requests, state.selected, openTrace);
  if (events.events.length || !state.lastSeq) {
    state.events = state.events.concat(events.events).slice(-MAX_EVENTS);
    state.lastSeq = events.events.length ? events.events[events.events.length - 1].seq : state.lastSeq;
    renderEvents(state.events);
  }
  chartState.windowS = series.window_s;
  chartState.intervalS = series.interval_s;
  chartState.samples = samples.concat(series.samples).slice(-MAX_SAMPLES);
  drawCharts();
  setConnection("live", `live · ${fmtClock(cluster.time)}`);
}

async function poll() {
  if (state.polling || !state.token) return;
  state.polling = true;
  try {
    await refresh();
  } catch (error) {
    if (error instanceof AuthError) {
      askForToken(REFUSED);
      return;
    }
    setConnection("error", "router unreachable: retrying");
  } finally {
    state.polling = false;
  }
  state.timer = setTimeout(poll, REFRESH_MS);
}

function start(token) {
  clearTimeout(state.timer);
  Object.assign(state, { token, events: [], lastSeq: 0 });
  chartState.samples = [];
  $("#auth").hidden = true;
  setConnection("connecting", "connecting…");
  poll();
}

function signIn(event) {
  event.preventDefault();
  const token = $("#auth-token").value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("#auth-token").value = "";
  start(token);
}

$("#auth-form").addEventListener("submit", signIn);
$("#sign-out").addEventListener("click", () => askForToken("Signed out. Paste the admin token to sign in again:"));
$("#waterfall-close").addEventListener("click", closeTrace);
$("#range").addEventListener("change", drawCharts);
window.addEventListener("resize", drawCharts);
window.addEventListener("hashchange", () => {
  const token = takeTokenFromFragment();
  if (token && token !== state.token) start(token);
});
watchChartHover();
const initial = takeTokenFromFragment();
if (initial) start(initial);
else askForToken("This page needs the router's admin token: open it as /dashboard#token=TOKEN, or paste the token here.");
