// InstGenIE editor: a plain ES module, no framework, no build step. It uses only the public
// native API (docs/api.md) through relative URLs, so it works against any server that serves
// this page at its root. Masks are painted on a canvas at the template's natural resolution and
// sent as a white-on-black PNG of the image's size (the native `mask` field).

const $ = (id) => document.getElementById(id);
const MASK_RGB = [255, 32, 80]; // colour of painted pixels on screen (alpha 255 = edit)
const UNDO_LIMIT = 30;

const state = {
  templates: [], // last GET v1/templates
  local: new Map(), // template id -> object URL of the image uploaded in this tab
  selected: null, // the selected template (its API view)
  maskFile: null, // an uploaded mask file, sent as is instead of the painting
  job: null, // {id, source: EventSource}
  history: [],
  pollTimer: null,
};

// ---- API ----------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, body, retryAfter) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || null;
    this.field = e.field || null;
    this.retryAfter = retryAfter;
  }
}

async function api(method, path, body) {
  const resp = await fetch(path, { method, body });
  let data = null;
  try {
    data = await resp.json();
  } catch {
    data = null;
  }
  if (!resp.ok) throw new ApiError(resp.status, data, resp.headers.get("Retry-After"));
  return data;
}

// ---- errors next to their fields ---------------------------------------------------------------
function clearErrors(prefix) {
  for (const el of document.querySelectorAll(`[id^="${prefix}-"][id$="-error"]`)) {
    el.textContent = "";
  }
  for (const el of document.querySelectorAll("[aria-invalid=true]")) {
    if (el.id.startsWith(prefix)) el.removeAttribute("aria-invalid");
  }
}

function showError(prefix, err) {
  let text = err.message;
  if (err.status === 429 || err.status === 503) {
    const wait = err.retryAfter ? ` Retry in ${err.retryAfter} s.` : "";
    text = `Server busy (${err.code || err.status}): ${err.message}.${wait}`;
  } else if (err.code) {
    text = `${err.message} (${err.code})`;
  }
  const slot = err.field && $(`${prefix}-${err.field}-error`);
  if (slot) {
    slot.textContent = text.startsWith(`${err.field}:`) ? text : `${err.field}: ${text}`;
    const input = document.querySelector(`[id^="${prefix}-"][name="${err.field}"]`) ||
      (err.field === "mask" ? $("mask-file") : null);
    if (input) input.setAttribute("aria-invalid", "true");
  } else {
    $(`${prefix}-form-error`).textContent = err.field ? `${err.field}: ${text}` : text;
  }
}

// ---- templates ---------------------------------------------------------------------------------
function formatBytes(n) {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(1)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  if (n >= 1 << 10) return `${(n / (1 << 10)).toFixed(1)} KiB`;
  return `${n} B`;
}

function tierText(t) {
  const held = Object.entries(t.bytes_by_tier || {}).filter(([, n]) => n > 0);
  if (!held.length) return "no cache";
  const total = held.reduce((s, [, n]) => s + n, 0);
  return `${held.map(([k]) => k).join("+")} ${formatBytes(total)}`;
}

function renderGallery() {
  const list = $("gallery");
  list.replaceChildren();
  for (const t of state.templates) {
    const li = document.createElement("li");
    li.dataset.id = t.id;
    li.dataset.status = t.status;
    if (state.selected && state.selected.id === t.id) li.classList.add("selected");
    const url = state.local.get(t.id);
    const thumb = document.createElement(url ? "img" : "div");
    thumb.className = "thumb";
    if (url) {
      thumb.src = url;
      thumb.alt = "";
    }
    const meta = document.createElement("div");
    meta.className = "meta";
    const status = document.createElement("strong");
    status.className = `status-${t.status}`;
    status.textContent = t.status;
    const short = t.id.slice(0, 10);
    meta.append(status, ` · ${tierText(t)} · ${t.width}×${t.height} · ${t.num_inference_steps} steps`);
    const cap = document.createElement("div");
    cap.textContent = `${short} ${t.prompt ? `“${t.prompt}”` : ""}`;
    meta.append(cap);
    if (t.error) {
      const err = document.createElement("div");
      err.className = "field-error";
      err.textContent = t.error;
      meta.append(err);
    }
    const select = document.createElement("button");
    select.type = "button";
    select.textContent = "Select";
    select.setAttribute("aria-label", `Select template ${short}`);
    select.addEventListener("click", () => selectTemplate(t));
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "Delete";
    del.setAttribute("aria-label", `Delete template ${short}`);
    del.addEventListener("click", () => deleteTemplate(t));
    meta.append(select, del);
    li.append(thumb, meta);
    list.append(li);
  }
  if (!state.templates.length) {
    const li = document.createElement("li");
    li.textContent = "None yet.";
    list.append(li);
  }
}

async function refreshTemplates() {
  clearTimeout(state.pollTimer);
  try {
    const body = await api("GET", "v1/templates");
    state.templates = body.data;
    if (state.selected) {
      const now = state.templates.find((t) => t.id === state.selected.id);
      if (now) state.selected = now;
    }
    renderGallery();
    updateSelectedText();
  } catch (err) {
    $("t-form-error").textContent = `Could not list templates: ${err.message}`;
  }
  const building = state.templates.some((t) => t.status === "building");
  state.pollTimer = setTimeout(refreshTemplates, building ? 500 : 5000);
}

async function registerTemplate(ev) {
  ev.preventDefault();
  clearErrors("t");
  const file = $("t-image").files[0];
  if (!file) {
    showError("t", { message: "choose an image file", field: "image" });
    return;
  }
  const body = new FormData();
  body.append("image", file, file.name);
  if ($("t-prompt").value) body.append("prompt", $("t-prompt").value);
  if ($("t-steps").value) body.append("num_inference_steps", $("t-steps").value);
  $("t-submit").disabled = true;
  try {
    const t = await api("POST", "v1/templates", body);
    if (!state.local.has(t.id)) state.local.set(t.id, URL.createObjectURL(file));
    selectTemplate(t);
    await refreshTemplates();
  } catch (err) {
    showError("t", err);
  } finally {
    $("t-submit").disabled = false;
  }
}

async function deleteTemplate(t) {
  try {
    await api("DELETE", `v1/templates/${encodeURIComponent(t.id)}`);
  } catch (err) {
    if (err.status !== 404) {
      $("t-form-error").textContent = `Could not delete: ${err.message}`;
      return;
    }
  }
  if (state.selected && state.selected.id === t.id) {
    state.selected = null;
    $("stage").hidden = true;
    updateSelectedText();
  }
  await refreshTemplates();
}

function updateSelectedText() {
  const t = state.selected;
  $("selected-template").textContent = t
    ? `Template ${t.id.slice(0, 10)} (${t.width}×${t.height}, ${t.status}).`
    : "No template selected: register one or pick one from the list.";
}

function selectTemplate(t) {
  state.selected = t;
  const url = state.local.get(t.id);
  const stage = $("stage");
  const img = $("base-image");
  stage.hidden = false;
  if (url) {
    stage.classList.remove("no-image");
    img.hidden = false;
    img.src = url;
    $("before-image").src = url;
  } else {
    stage.classList.add("no-image");
    img.hidden = true;
    img.removeAttribute("src");
    $("before-image").removeAttribute("src");
  }
  canvas.width = t.width;
  canvas.height = t.height;
  undoStack.length = 0;
  setMaskFile(null);
  updateRatio();
  updateSelectedText();
  renderGallery();
}

// ---- mask painting -----------------------------------------------------------------------------
const canvas = $("mask-canvas");
const ctx = canvas.getContext("2d", { willReadFrequently: true });
const undoStack = [];
let stroke = null; // {tool, last: [x, y], start, snapshot} while a pointer is down
let ratioQueued = false;

function tool() {
  return document.querySelector('input[name="tool"]:checked').value;
}

function brushSize() {
  return Number($("brush-size").value);
}

function pushUndo() {
  undoStack.push(ctx.getImageData(0, 0, canvas.width, canvas.height));
  if (undoStack.length > UNDO_LIMIT) undoStack.shift();
}

function toImage(ev) {
  const r = canvas.getBoundingClientRect();
  return [
    ((ev.clientX - r.left) * canvas.width) / r.width,
    ((ev.clientY - r.top) * canvas.height) / r.height,
  ];
}

function paintStyle(kind) {
  ctx.globalCompositeOperation = kind === "eraser" ? "destination-out" : "source-over";
  ctx.strokeStyle = ctx.fillStyle = `rgb(${MASK_RGB.join(",")})`;
  ctx.lineWidth = brushSize();
  ctx.lineCap = ctx.lineJoin = "round";
}

function dot([x, y]) {
  ctx.beginPath();
  ctx.arc(x, y, brushSize() / 2, 0, 2 * Math.PI);
  ctx.fill();
}

canvas.addEventListener("pointerdown", (ev) => {
  if (!state.selected || ev.button > 0) return;
  ev.preventDefault();
  canvas.setPointerCapture(ev.pointerId);
  pushUndo();
  setMaskFile(null);
  const p = toImage(ev);
  const kind = tool();
  stroke = { tool: kind, last: p, start: p, snapshot: null };
  paintStyle(kind);
  if (kind === "rect") stroke.snapshot = ctx.getImageData(0, 0, canvas.width, canvas.height);
  else dot(p);
  queueRatio();
});

canvas.addEventListener("pointermove", (ev) => {
  if (!stroke) return;
  const p = toImage(ev);
  if (stroke.tool === "rect") {
    ctx.putImageData(stroke.snapshot, 0, 0);
    ctx.globalCompositeOperation = "source-over";
    const [x0, y0] = stroke.start;
    ctx.fillRect(Math.min(x0, p[0]), Math.min(y0, p[1]), Math.abs(p[0] - x0), Math.abs(p[1] - y0));
  } else {
    ctx.beginPath();
    ctx.moveTo(...stroke.last);
    ctx.lineTo(...p);
    ctx.stroke();
    stroke.last = p;
  }
  queueRatio();
});

function endStroke() {
  if (!stroke) return;
  stroke = null;
  ctx.globalCompositeOperation = "source-over";
  updateRatio();
}
canvas.addEventListener("pointerup", endStroke);
canvas.addEventListener("pointercancel", endStroke);

function queueRatio() {
  if (ratioQueued) return;
  ratioQueued = true;
  requestAnimationFrame(() => {
    ratioQueued = false;
    updateRatio();
  });
}

function updateRatio() {
  const n = canvas.width * canvas.height;
  if (!n) {
    $("mask-ratio").value = "0.0%";
    return;
  }
  const a = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  let on = 0;
  for (let i = 3; i < a.length; i += 4) if (a[i] >= 128) on++;
  $("mask-ratio").value = `${((100 * on) / n).toFixed(1)}%`;
}

function editPixels(fn) {
  if (!state.selected) return;
  pushUndo();
  setMaskFile(null);
  const img = ctx.getImageData(0, 0, canvas.width, canvas.height);
  const d = img.data;
  for (let i = 0; i < d.length; i += 4) {
    const on = fn(d[i + 3] >= 128);
    d[i] = MASK_RGB[0];
    d[i + 1] = MASK_RGB[1];
    d[i + 2] = MASK_RGB[2];
    d[i + 3] = on ? 255 : 0;
  }
  ctx.putImageData(img, 0, 0);
  updateRatio();
}

$("clear").addEventListener("click", () => editPixels(() => false));
$("invert").addEventListener("click", () => editPixels((on) => !on));
$("undo").addEventListener("click", () => {
  const img = undoStack.pop();
  if (img) ctx.putImageData(img, 0, 0);
  updateRatio();
});
$("brush-size").addEventListener("input", () => {
  $("brush-size-out").value = $("brush-size").value;
});

function setMaskFile(file) {
  state.maskFile = file;
  if (!file) $("mask-file").value = "";
  $("e-mask-error").textContent = "";
  $("mask-file").removeAttribute("aria-invalid");
}

$("mask-file").addEventListener("change", async () => {
  const file = $("mask-file").files[0] || null;
  state.maskFile = file;
  $("e-mask-error").textContent = "";
  if (!file || !state.selected) return;
  // shown on the canvas when it has the template's size; sent as is either way (the server
  // checks it and names the field if it does not fit)
  const bmp = await createImageBitmap(file).catch(() => null);
  if (bmp && bmp.width === canvas.width && bmp.height === canvas.height) {
    pushUndo();
    const tmp = new OffscreenCanvas(bmp.width, bmp.height).getContext("2d");
    tmp.drawImage(bmp, 0, 0);
    const src = tmp.getImageData(0, 0, bmp.width, bmp.height).data;
    const img = ctx.createImageData(bmp.width, bmp.height);
    for (let i = 0; i < src.length; i += 4) {
      img.data.set(MASK_RGB, i);
      img.data[i + 3] = src[i] >= 128 ? 255 : 0;
    }
    ctx.putImageData(img, 0, 0);
    updateRatio();
  }
});

/** The painted mask as a white (edit) on black PNG of the template's size. */
function exportMask() {
  const out = document.createElement("canvas");
  out.width = canvas.width;
  out.height = canvas.height;
  const src = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  const octx = out.getContext("2d");
  const img = octx.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < src.length; i += 4) {
    const v = src[i + 3] >= 128 ? 255 : 0;
    img.data[i] = img.data[i + 1] = img.data[i + 2] = v;
    img.data[i + 3] = 255;
  }
  octx.putImageData(img, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

// ---- edits -------------------------------------------------------------------------------------
$("random-seed").addEventListener("click", () => {
  $("e-seed").value = String(Math.floor(Math.random() * 2 ** 31));
});

function setBusy(busy) {
  $("e-submit").disabled = busy;
  $("e-cancel").disabled = !busy;
}

function logEvent(text) {
  const log = $("job-log");
  log.textContent = log.textContent ? `${log.textContent} → ${text}` : text;
}

async function submitEdit(ev) {
  ev.preventDefault();
  clearErrors("e");
  if (!state.selected) {
    showError("e", { message: "select or register a template first", field: "template_id" });
    return;
  }
  const body = new FormData();
  body.append("template_id", state.selected.id);
  const mask = state.maskFile || (await exportMask());
  body.append("mask", mask, state.maskFile ? state.maskFile.name : "mask.png");
  for (const id of ["e-prompt", "e-negative", "e-seed", "e-steps", "e-guidance", "e-strength"]) {
    const el = $(id);
    if (el.value !== "") body.append(el.name, el.value);
  }
  body.append("output_format", $("e-format").value);
  setBusy(true);
  $("job-log").textContent = "";
  $("job-status").textContent = "Submitting…";
  let job;
  try {
    job = await api("POST", "v1/edits?async=true", body);
  } catch (err) {
    setBusy(false);
    $("job-status").textContent = "Not submitted.";
    showError("e", err);
    return;
  }
  follow(job.id, $("e-format").value);
}

function follow(id, format) {
  const progress = $("progress");
  progress.removeAttribute("value"); // indeterminate until the first step
  const source = new EventSource(`v1/jobs/${encodeURIComponent(id)}/events`);
  state.job = { id, source };
  const status = $("job-status");
  const on = (name, fn) =>
    source.addEventListener(name, (e) => fn(e.data ? JSON.parse(e.data) : {}));
  on("queued", (d) => {
    status.textContent = `Queued, position ${d.position ?? "?"}.`;
    logEvent(`queued (${d.position ?? "?"})`);
  });
  on("running", (d) => {
    status.textContent = `Running: ${d.stage || "started"}.`;
    logEvent(`running ${d.stage || ""}`.trim());
  });
  on("stage", (d) => {
    status.textContent = `Running: ${d.stage}.`;
    logEvent(d.stage);
  });
  on("step", (d) => {
    progress.max = d.num_steps;
    progress.value = d.step;
    status.textContent = `Step ${d.step} / ${d.num_steps}.`;
    logEvent(`step ${d.step}/${d.num_steps}`);
  });
  const finish = () => {
    source.close();
    state.job = null;
    setBusy(false);
  };
  on("done", async () => {
    logEvent("done");
    finish();
    progress.value = progress.max;
    try {
      const full = await api("GET", `v1/jobs/${encodeURIComponent(id)}`);
      showResult(full.result, format);
      status.textContent = "Done.";
    } catch (err) {
      status.textContent = "Finished, but the result could not be read.";
      showError("e", err);
    }
  });
  on("failed", (d) => {
    logEvent("failed");
    finish();
    progress.value = 0;
    status.textContent = "Failed.";
    showError("e", { ...(d.error || {}), message: (d.error || {}).message || "the edit failed" });
  });
  on("cancelled", () => {
    logEvent("cancelled");
    finish();
    progress.value = 0;
    status.textContent = "Cancelled.";
  });
  source.onerror = async () => {
    if (!state.job || state.job.id !== id) return;
    if (source.readyState !== EventSource.CLOSED) {
      status.textContent = "Connection lost; reconnecting…";
      return;
    }
    // the stream is gone for good (the job is unknown to the server now): say what it knows
    finish();
    progress.value = 0;
    try {
      const job = await api("GET", `v1/jobs/${encodeURIComponent(id)}`);
      status.textContent = `The job's events ended; it is ${job.status}.`;
    } catch (err) {
      status.textContent = "The job is no longer known to the server.";
      showError("e", err);
    }
  };
}

async function cancelJob() {
  const job = state.job;
  if (!job) return;
  // the job's "cancelled" event may arrive before this answer does: say it first
  $("job-status").textContent = "Cancelling…";
  try {
    await api("DELETE", `v1/jobs/${encodeURIComponent(job.id)}`);
  } catch (err) {
    showError("e", err);
  }
}

function b64Blob(b64, type) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Blob([bytes], { type });
}

function showResult(r, format) {
  const type = `image/${r.output_format || format}`;
  const url = URL.createObjectURL(b64Blob(r.image, type));
  const entry = {
    url,
    before: state.local.get(r.template_id) || null,
    result: r,
    name: `edit-${r.id}.${r.output_format === "jpeg" ? "jpg" : r.output_format}`,
  };
  state.history.unshift(entry);
  display(entry);
  renderHistory();
}

function display(entry) {
  const r = entry.result;
  $("compare").hidden = false;
  $("after-image").src = entry.url;
  if (entry.before) $("before-image").src = entry.before;
  else $("before-image").removeAttribute("src");
  const link = $("download");
  link.href = entry.url;
  link.download = entry.name;
  link.hidden = false;
  const t = r.timings || {};
  const rows = [
    ["Path", r.path + (r.fallback_reason ? ` (${r.fallback_reason})` : "")],
    ["Cache", `${r.cache ?? "none"}${r.cache_tier ? `, tier ${r.cache_tier}` : ""}`],
    ["Size", `${r.width}×${r.height}`],
    ["Steps", r.num_steps],
    ["Seed", r.seed],
    ["Mask ratio", `${(100 * r.mask_ratio).toFixed(1)}%`],
    ["Worker", r.worker],
    ["Timings", ["queue_ms", "denoise_ms", "total_ms", "server_total_ms"]
      .filter((k) => t[k] != null).map((k) => `${k.replace("_ms", "")} ${t[k].toFixed(0)} ms`)
      .join(", ")],
  ];
  const dl = $("result-info");
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = String(v);
    dd.dataset.key = k.toLowerCase().replace(" ", "_");
    dl.append(dt, dd);
  }
  applySlider();
}

function renderHistory() {
  const ol = $("history");
  ol.replaceChildren();
  for (const entry of state.history) {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.type = "button";
    const img = document.createElement("img");
    img.src = entry.url;
    img.alt = "";
    const r = entry.result;
    b.append(img, `seed ${r.seed} · ${r.path} · ${r.num_steps} steps`);
    b.addEventListener("click", () => display(entry));
    li.append(b);
    ol.append(li);
  }
}

function applySlider() {
  $("after-image").style.clipPath = `inset(0 0 0 ${$("compare-slider").value}%)`;
}
$("compare-slider").addEventListener("input", applySlider);

// ---- start -------------------------------------------------------------------------------------
$("template-form").addEventListener("submit", registerTemplate);
$("edit-form").addEventListener("submit", submitEdit);
$("e-cancel").addEventListener("click", cancelJob);
for (const el of document.querySelectorAll("#edit-form input, #edit-form select")) {
  el.addEventListener("input", () => {
    el.removeAttribute("aria-invalid");
    const slot = $(`e-${el.name}-error`);
    if (slot) slot.textContent = "";
  });
}
api("GET", "v1/models")
  .then((m) => {
    $("server-info").textContent = `Model ${m.data.map((x) => x.id).join(", ")}`;
  })
  .catch(() => {});
refreshTemplates();
