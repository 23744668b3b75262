"""The page `torchsprint serve` shows at /: drop images (or choose them) and see each one's top-k classes. One
self-contained HTML document (no file, script or font fetched from anywhere), which posts each image to /predict
as its raw body, exactly as `curl --data-binary @cat.jpg` does."""

from __future__ import annotations

import html
import json

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>torchsprint serve: __NAME__</title>
<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 2rem auto; max-width: 46rem; padding: 0 1rem; color: #222; }
h1 { font-size: 1.3rem; } .muted { color: #666; }
#drop { border: 2px dashed #888; border-radius: 8px; padding: 2.5rem 1rem; text-align: center; cursor: pointer; }
#drop.over { background: #eef4ff; border-color: #36c; }
.result { display: flex; gap: 1rem; margin: 1rem 0; padding: .75rem; border: 1px solid #ddd; border-radius: 6px; }
.result img { width: 96px; height: 96px; object-fit: contain; background: #f4f4f4; image-rendering: pixelated; }
table { border-collapse: collapse; flex: 1; } td { padding: .1rem .5rem; }
.bar { background: #36c; height: .7rem; border-radius: 2px; } .error { color: #b00; }
label { margin-right: 1rem; }
</style></head>
<body data-state="idle">
<h1>torchsprint serve</h1>
<p class="muted">Model: <code>__NAME__</code>. Images are sent to <code>POST /predict</code> and preprocessed exactly as
<code>torchsprint predict</code> does. <a href="docs">API</a> · <a href="metrics">metrics</a></p>
<p><label>top-k <input id="topk" type="number" min="1" value="__TOPK__" style="width:4rem"></label>
<label id="token-row" __TOKEN_HIDDEN__>token <input id="token" type="password" autocomplete="off"></label></p>
<div id="drop" tabindex="0">Drop images here, or click to choose<input id="files" type="file" accept="image/*" multiple hidden></div>
<div id="results"></div>
<script>
"use strict";
const drop = document.getElementById("drop"), input = document.getElementById("files");
const results = document.getElementById("results");
let pending = 0;
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
async function send(file) {
  pending++; document.body.dataset.state = "busy";
  const box = document.createElement("section"); box.className = "result"; box.dataset.file = file.name;
  const img = document.createElement("img"); img.src = URL.createObjectURL(file); img.alt = file.name;
  const table = document.createElement("table"); box.append(img, table); results.prepend(box);
  cell(table.insertRow(), file.name, "muted").colSpan = 3;
  const headers = {"Content-Type": file.type || "application/octet-stream"};
  const token = document.getElementById("token").value;
  if (token) headers["Authorization"] = "Bearer " + token;
  try {
    const k = Math.max(1, parseInt(document.getElementById("topk").value, 10) || __TOPK__);
    const r = await fetch("predict?topk=" + k, {method: "POST", headers, body: file});
    const answer = await r.json();
    const p = (answer.predictions || [])[0] || {};
    if (!r.ok || p.error) throw new Error(p.error || answer.error || ("HTTP " + r.status));
    for (const t of (p.top || p.labels || [])) {
      const row = table.insertRow(); row.className = "pred"; row.dataset.class = t.class; row.dataset.prob = t.prob;
      cell(row, t.class, "label"); cell(row, t.prob.toFixed(4), "prob");
      const bar = document.createElement("div"); bar.className = "bar"; bar.style.width = (100 * t.prob).toFixed(1) + "%";
      row.insertCell().append(bar);
    }
    box.dataset.state = "done";
  } catch (e) {
    cell(table.insertRow(), String(e.message || e), "error").colSpan = 3; box.dataset.state = "error";
  } finally {
    if (--pending === 0) document.body.dataset.state = "done";
  }
}
function sendAll(files) { for (const f of files) send(f); }
drop.addEventListener("click", () => input.click());
drop.addEventListener("keydown", e => { if (e.key === "Enter" || e.key === " ") input.click(); });
input.addEventListener("change", () => { sendAll(input.files); input.value = ""; });
for (const t of ["dragenter", "dragover"]) drop.addEventListener(t, e => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", e => { e.preventDefault(); drop.classList.remove("over"); sendAll(e.dataTransfer.files); });
</script>
</body></html>
"""  # noqa: E501


def page_html(name: str, topk: int, token: bool) -> str:
    """The page for a server of `name` (shown, escaped), its default top-k and whether it asks for a token."""
    return (
        PAGE.replace("__NAME__", html.escape(name))
        .replace("__TOPK__", json.dumps(int(topk)))
        .replace("__TOKEN_HIDDEN__", "" if token else "hidden")
    )
