// The live page of `python -m infer.server --live-page`: reads the server-sent events of
// /live/events (src/infer/server/routes/live.py) and draws the engine's queues, KV-cache blocks,
// last steps and latencies. Plain JavaScript, no library.
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_STEPS = 600;      // step events kept for the timeline and the rates
const MAX_TTFT = 200;       // times to first token kept
const KEY_STORE = "infer-live-key";

const S = {
  instance: null, info: null, state: null, codes: [], owners: [],
  steps: [], ttft: [], dropped: 0, key: null, drawQueued: false,
};

// ------------------------------------------------------------------ connection

function keyFromAddress() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) {  // keep it for this tab only, and take it out of the address bar and the history
    sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem(KEY_STORE);
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (cls || "");
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

class Unauthorized extends Error {}

async function readStream() {
  const headers = S.key ? { Authorization: "Bearer " + S.key } : {};
  const r = await fetch("/live/events", { headers, cache: "no-store" });
  if (r.status === 401) throw new Unauthorized();
  if (!r.ok || !r.body) throw new Error("HTTP " + r.status);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      dispatch(buf.slice(0, i));
      buf = buf.slice(i + 2);
    }
  }
}

function dispatch(block) {  // one server-sent event: "event: NAME" and "data: JSON" lines
  let event = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;  // a keep-alive comment
  const d = JSON.parse(data);
  if (event === "hello") onHello(d);
  else if (event === "state") onState(d);
  else if (event === "steps") onSteps(d);
  else if (event === "dropped") S.dropped += d.events;
  else if (event === "stopped") setStatus("engine stopped", "bad");
}

async function connect() {
  S.key = keyFromAddress();
  for (let attempt = 0; ; attempt++) {
    try {
      await readStream();
      attempt = 0;
    } catch (e) {
      if (e instanceof Unauthorized) {
        sessionStorage.removeItem(KEY_STORE);
        setStatus(S.key ? "wrong API key" : "API key needed", "bad");
        $("keyform").hidden = false;
        return;  // the form calls connect() again
      }
    }
    setStatus("disconnected: reconnecting…", "bad");
    await sleep(Math.min(4000, 250 * 2 ** Math.min(attempt, 4)));
  }
}

$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key").value);
  $("keyform").hidden = true;
  connect();
});

// ------------------------------------------------------------------ events

function onHello(d) {
  if (d.instance !== S.instance) {  // a new server process: what we drew belongs to the old one
    S.steps = []; S.ttft = []; S.dropped = 0;
  }
  S.instance = d.instance;
  S.info = d.info;
  $("model").textContent = `${d.info.model} on ${d.info.device} · ${d.info.flags}`;
  $("kv-shape").textContent = `${d.info.num_blocks} blocks × ${d.info.block_size} tokens`;
  setStatus("live", "ok");
}

function onState(st) {
  S.state = st;
  S.codes = expand(st.blocks);
  S.owners = st.running.map((r) => r.id);
  renderQueues(st);
  renderBlockCounts(st);
  queueDraw();
}

function onSteps(list) {
  for (const e of list) {
    S.steps.push(e);
    for (const [rid, ms] of e.ttft) S.ttft.push({ t: e.t, rid, ms });
  }
  if (S.steps.length > MAX_STEPS) S.steps.splice(0, S.steps.length - MAX_STEPS);
  if (S.ttft.length > MAX_TTFT) S.ttft.splice(0, S.ttft.length - MAX_TTFT);
  renderLastStep(S.steps[S.steps.length - 1]);
  renderLatency();
  queueDraw();
}

function expand(runs) {  // [[code, count], ...] -> one code per block
  const out = [];
  for (const [code, n] of runs) for (let i = 0; i < n; i++) out.push(code);
  return out;
}

// ------------------------------------------------------------------ colours

function hue(s) {  // a stable colour per request id
  let h = 2166136261;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619);
  return ((h >>> 0) * 137.508) % 360;
}
const requestColour = (rid) => `hsl(${hue(rid).toFixed(0)}, 62%, 52%)`;
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

function blockColour(code) {
  if (code === -1) return css("--free");
  if (code === -2) return css("--cached");
  if (code === -3) return css("--shared");
  return requestColour(S.owners[code] || "?");
}

// ------------------------------------------------------------------ queues and counts

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function renderQueues(st) {
  const run = $("running");
  run.replaceChildren();
  for (const r of st.running) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = r.id;
    const td = cell(tr, "", "rid");
    const sw = document.createElement("i");
    sw.className = "sw";
    sw.style.background = requestColour(r.id);
    td.append(sw, r.id);
    td.title = r.id;
    cell(tr, r.seqs);
    cell(tr, r.cached ? `${r.prompt} (${r.cached} cached)` : r.prompt);
    cell(tr, r.computed);
    cell(tr, r.generated);
    cell(tr, r.blocks);
    cell(tr, r.ttft_ms == null ? "–" : r.ttft_ms.toFixed(1));
    run.appendChild(tr);
  }
  $("running-count").textContent = st.running.length;
  const wait = $("waiting");
  wait.replaceChildren();
  for (const w of st.waiting) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = w.id;
    if (w.preempted) tr.className = "preempted";
    cell(tr, w.preempted ? `${w.id} (preempted)` : w.id, "rid").title = w.id;
    cell(tr, w.prompt);
    cell(tr, w.generated);
    cell(tr, w.age_ms.toFixed(0));
    wait.appendChild(tr);
  }
  $("waiting-count").textContent = st.waiting.length + st.waiting_more;
}

function renderBlockCounts(st) {
  let held = 0, shared = 0, cached = 0, free = 0;
  for (const c of S.codes) {
    if (c >= 0) held++;
    else if (c === -3) shared++;
    else if (c === -2) cached++;
    else free++;
  }
  $("kv-used").textContent = held + shared;  // what the page draws as used: the engine's count is st.kv.used
  $("kv-used").title = `engine: ${st.kv.used} used, ${st.kv.cached} cached, ${st.kv.free} free`;
  $("kv-shared").textContent = shared;
  $("kv-cached").textContent = cached;
  $("kv-free").textContent = free;
  $("kv-usage").textContent = (100 * st.kv.usage).toFixed(1) + "%";
  const off = st.offload;
  $("offload").hidden = !off;
  if (off) {
    $("host-used").textContent = off.host_used;
    $("host-cap").textContent = off.host_capacity;
    $("disk").textContent = off.disk_capacity ? `disk tier ${off.disk_used} / ${off.disk_capacity} blocks` : "";
  }
}

// ------------------------------------------------------------------ the last step and latencies

function renderLastStep(e) {
  if (!e) return;
  const counts = {};
  for (const [, , phase, tokens] of e.seqs) {
    const c = (counts[phase] = counts[phase] || { n: 0, tokens: 0 });
    c.n++; c.tokens += tokens;
  }
  const parts = Object.entries(counts).map(([p, c]) => `${c.n} ${p}${c.n > 1 ? "s" : ""} (${c.tokens} tok)`);
  if (e.more) parts.push(`+${e.more} more`);
  const budget = S.info ? S.info.token_budget : 0;
  const [sch, fwd, out] = e.host_ms;
  $("laststep").textContent =
    `step ${e.step} · ${e.name} · ${parts.join(" + ") || "nothing scheduled"} · ` +
    `${e.prefill + e.decode}/${budget} budget · ${e.ms.toFixed(1)} ms ` +
    `(schedule ${sch.toFixed(2)}, forward ${fwd.toFixed(2)}, outputs ${out.toFixed(2)})` +
    (e.graph ? ` · graph ${e.graph}` : "") + (e.preempted.length ? ` · preempted ${e.preempted.join(", ")}` : "") +
    (S.dropped ? ` · ${S.dropped} events missed` : "");
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.floor(s.length / 2)] : null;
}

function renderLatency() {
  const steps = S.steps;
  if (!steps.length) return;
  const last = steps[steps.length - 1];
  if (S.ttft.length) {
    $("ttft-last").textContent = S.ttft[S.ttft.length - 1].ms.toFixed(1) + " ms";
    $("ttft-median").textContent = median(S.ttft.slice(-50).map((x) => x.ms)).toFixed(1) + " ms";
  }
  const recent = steps.filter((e) => e.t >= last.t - 2000);
  const first = recent[0];
  const dn = last.itl[1] - first.itl[1];
  $("itl").textContent = dn > 0 ? ((1e3 * (last.itl[0] - first.itl[0])) / dn).toFixed(1) + " ms" : "–";
  const span = (last.t + last.ms - first.t) / 1e3;
  if (span > 0) {
    const tokens = recent.reduce((a, e) => a + e.prefill + e.decode, 0);
    $("steps-rate").textContent = (recent.length / span).toFixed(1);
    $("tok-rate").textContent = (tokens / span).toFixed(0);
  }
}

// ------------------------------------------------------------------ drawing

function queueDraw() {
  if (S.drawQueued) return;
  S.drawQueued = true;
  requestAnimationFrame(() => { S.drawQueued = false; drawBlocks(); drawTimeline(); drawLatency(); });
}

function fit(canvas, height) {  // size the canvas to its CSS width, sharp on high-DPI screens
  const w = canvas.clientWidth || 600, r = window.devicePixelRatio || 1;
  canvas.style.height = height + "px";
  if (canvas.width !== Math.round(w * r) || canvas.height !== Math.round(height * r)) {
    canvas.width = Math.round(w * r);
    canvas.height = Math.round(height * r);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(r, 0, 0, r, 0, 0);
  ctx.clearRect(0, 0, w, height);
  return [ctx, w];
}

function grid(n, w) {  // cell size and columns that show n blocks in about 260 px of height
  const cell = Math.max(2, Math.min(18, Math.floor(Math.sqrt((w * 260) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor(w / cell));
  return { cell, cols, rows: Math.ceil(n / cols) };
}

function drawBlocks() {
  const n = S.codes.length, canvas = $("blockmap");
  if (!n) return;
  const g = grid(n, canvas.clientWidth || 600);
  const [ctx] = fit(canvas, g.rows * g.cell);
  const gap = g.cell >= 6 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = blockColour(S.codes[i]);
    ctx.fillRect((i % g.cols) * g.cell, Math.floor(i / g.cols) * g.cell, g.cell - gap, g.cell - gap);
  }
  S.grid = g;
  const off = S.state && S.state.offload;
  if (off) {
    const hg = grid(off.host_capacity, canvas.clientWidth || 600);
    const hc = Math.min(hg.cell, 10), cols = Math.max(1, Math.floor((canvas.clientWidth || 600) / hc));
    const [hctx] = fit($("hostmap"), Math.ceil(off.host_capacity / cols) * hc);
    for (let i = 0; i < off.host_capacity; i++) {
      hctx.fillStyle = i < off.host_used ? css("--host") : css("--free");
      hctx.fillRect((i % cols) * hc, Math.floor(i / cols) * hc, hc - (hc >= 6 ? 1 : 0), hc - (hc >= 6 ? 1 : 0));
    }
  }
}

$("blockmap").addEventListener("mousemove", (ev) => {
  const g = S.grid;
  if (!g) return;
  const r = ev.target.getBoundingClientRect();
  const i = Math.floor((ev.clientY - r.top) / g.cell) * g.cols + Math.floor((ev.clientX - r.left) / g.cell);
  const code = S.codes[i];
  if (code === undefined) return;
  const what = code === -1 ? "free" : code === -2 ? "cached (free, holds a prefix-cache block)"
    : code === -3 ? "shared by several requests" : `held by ${S.owners[code]}`;
  $("hover").textContent = `block ${i}: ${what}`;
});

function drawTimeline() {
  const canvas = $("timeline");
  const [ctx, w] = fit(canvas, 150);
  const H = 130, top = 10, bar = 5;
  const shown = S.steps.slice(-Math.floor(w / bar));
  const budget = (S.info && S.info.token_budget) || Math.max(1, ...shown.map((e) => e.prefill + e.decode));
  const y = (tokens) => (H * Math.log2(1 + tokens)) / Math.log2(1 + budget);
  ctx.strokeStyle = "#bbb";
  ctx.setLineDash([4, 3]);
  ctx.beginPath(); ctx.moveTo(0, top + 0.5); ctx.lineTo(w, top + 0.5); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = "#777";
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(`budget ${budget}`, 2, top - 1);
  shown.forEach((e, k) => {
    const x = k * bar, total = e.prefill + e.decode, h = y(total);
    const hp = total ? (h * e.prefill) / total : 0;
    ctx.fillStyle = css("--prefill");
    ctx.fillRect(x, top + H - hp, bar - 1, hp);
    ctx.fillStyle = css("--decode");
    ctx.fillRect(x, top + H - h, bar - 1, h - hp);
    if (e.preempted.length) { ctx.fillStyle = css("--preempt"); ctx.fillRect(x, top, bar - 1, 5); }
    if (e.graph) { ctx.fillStyle = css("--graph"); ctx.fillRect(x, top + H + 3, bar - 1, 3); }
  });
}

function drawLatency() {
  const canvas = $("latency");
  const [ctx, w] = fit(canvas, 140);
  if (!S.steps.length) return;
  const H = 120, top = 10, now = S.steps[S.steps.length - 1].t, span = 30000;  // the last 30 s
  const itl = [];
  for (let k = 1; k < S.steps.length; k++) {
    const a = S.steps[k - 1], b = S.steps[k], dn = b.itl[1] - a.itl[1];
    if (dn > 0) itl.push({ t: b.t, ms: (1e3 * (b.itl[0] - a.itl[0])) / dn });
  }
  const pts = [...S.ttft, ...itl].filter((p) => p.t >= now - span);
  const ymax = Math.max(1, ...pts.map((p) => p.ms)) * 1.1;
  const x = (t) => w - ((now - t) / span) * w, y = (ms) => top + H - (H * ms) / ymax;
  ctx.fillStyle = "#777";
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(`${ymax.toFixed(0)} ms`, 2, top - 1);
  ctx.fillText("last 30 s", w - 44, top + H + 9);
  const dot = (p, colour) => { ctx.fillStyle = colour; ctx.fillRect(x(p.t) - 1.5, y(p.ms) - 1.5, 3, 3); };
  for (const p of itl) if (p.t >= now - span) dot(p, css("--itl"));
  for (const p of S.ttft) if (p.t >= now - span) dot(p, css("--ttft"));
}

window.addEventListener("resize", queueDraw);
connect();
