// symcost explore: the page's script. SYMCOST (the data, symcost/render/explore.py) holds the
// passes' formulas compiled to JavaScript by sympy's code printer; this script evaluates them at
// the controls' values, formats them as the CLI's text does (symcost.render.report.human) and
// draws them with uPlot. It computes no cost of its own but the roofline's per-op max and sum
// (symcost.passes.roofline.bound_of) and the max-batch search (MemoryModel.solve).
"use strict";
(function () {
  const D = SYMCOST;
  const SCALES = {
    B: [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]],
    FLOP: [["EFLOP", 1e18], ["PFLOP", 1e15], ["TFLOP", 1e12], ["GFLOP", 1e9], ["MFLOP", 1e6], ["kFLOP", 1e3]],
  };
  // Python's f"{x:.{n}f}": the exact value rounded, an exact tie to even (Number.toFixed takes the
  // larger: 3.5625 -> "3.563" where Python prints "3.562")
  function fixed(x, n) {
    const s = x.toFixed(n);
    if (!Number.isFinite(x) || Math.abs(x) >= 1e21) return s;
    const ex = Math.abs(x).toFixed(100); // the double's exact decimal expansion
    const dot = ex.indexOf(".");
    if (!/^50*$/.test(ex.slice(dot + 1 + n))) return s; // not an exact tie
    const keep = n > 0 ? ex.slice(0, dot + 1 + n) : ex.slice(0, dot);
    return Number(keep[keep.length - 1]) % 2 === 0 ? (x < 0 ? "-" : "") + keep : s;
  }
  // symcost.render.report.human: three decimals and a unit (bytes binary, FLOPs decimal)
  function human(v, unit) {
    for (const [u, f] of SCALES[unit]) if (Math.abs(v) >= f) return fixed(v / f, 3) + " " + u;
    return Math.trunc(v) + " " + unit;
  }
  const ms = (s) => fixed(s * 1e3, 4) + " ms";
  const pct = (x) => fixed(100 * x, 2) + "%";
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const k of kids) e.append(k);
    return e;
  };

  // ---- state -------------------------------------------------------------------------------
  const state = { v: {}, precision: D.variants[0].precision, layout: "none", ac: "none", device: D.device };
  for (const s of D.symbols) state.v[s.name] = s.value;
  const precisions = [...new Set(D.variants.map((x) => x.precision))];
  const layouts = [...new Set(D.variants.map((x) => x.shard || "none"))];
  const acs = [...new Set(D.variants.map((x) => x.ac || "none"))];
  const variant = (p, l, a) => D.variants.find((x) => x.key === `${p}|${l}|${a}`);
  const device = () => D.devices.find((d) => d.key === state.device);
  const sizes = (over) => Object.assign({}, D.pinned, state.v, over || {});

  // ---- the passes' formulas at the controls' values ----------------------------------------
  function memory(vr, v) {
    const out = {};
    for (const [k, f] of Object.entries(vr.memory.categories)) out[k] = Math.round(f(v));
    out.peak = vr.memory.peak ? Math.round(vr.memory.peak(v)) : null;
    return out;
  }
  // MemoryModel.solve: the largest B whose peak fits under cap (the peak grows with B)
  function maxBatch(vr, v, cap) {
    const peak = (b) => vr.memory.peak(Object.assign({}, v, { B: b }));
    if (peak(1) > cap) return 0;
    let lo = 1, hi = 2;
    while (peak(hi) <= cap && hi < 2 ** 40) { lo = hi; hi *= 2; }
    while (hi - lo > 1) { const m = Math.floor((lo + hi) / 2); if (peak(m) <= cap) lo = m; else hi = m; }
    return lo;
  }
  function peakFor(dev, key) {  // Device.peak_for
    for (const k of D.fallback[key] || [key]) if (k in dev.peak) return dev.peak[k];
    return null;
  }
  // symcost.passes.roofline.roofline (fused bytes): each op's bound, the step's sum
  function roofline(vr, dev, v) {
    const bw = dev.bandwidth, wbw = dev.write_bandwidth || dev.bandwidth;
    let step = 0;
    const pts = [];
    for (const op of vr.ops) {
      const peak = peakFor(dev, op.key);
      const rep = op.rep(v), F = op.F(v), B = op.Bf(v), W = op.Wf(v);
      let ttr = 0;
      for (const [cls, n] of Object.entries(op.T)) {
        const c = n(v), r = dev.rates[cls] !== undefined ? dev.rates[cls] : dev.rates.all;
        if (c && r) ttr += c / r;
      }
      const tmem = (B - W) / bw + W / wbw, tcmp = F / peak;
      const t = Math.max(tmem, Math.max(tcmp, ttr));
      step += rep * t;
      if (B > 0 && F > 0) pts.push({ op: op.op, I: F / B, att: t ? F / t : peak, phase: op.phase });
    }
    const modelFlops = vr.flops.train(v);
    const peakTrain = peakFor(dev, vr.train_key);
    return { step, mfu: step ? modelFlops / (step * peakTrain) : 0, pts, peakTrain };
  }

  // ---- the controls ------------------------------------------------------------------------
  const app = document.getElementById("app");
  app.append(el("h1", { text: `symcost explore: ${D.model}` }));
  app.append(el("p", { class: "note", text: "Every number is one of symcost's formulas for this model (compiled to "
    + "JavaScript by sympy's code printer), evaluated at the values below: the same figures as "
    + "symcost report / roofline / checkpoint --json at the same --set values. The formulas hold in the regime "
    + "they were traced in (sizes of 1 trace other kernels)." }));
  const controls = el("div", { class: "controls" });
  app.append(controls);
  const inputs = {};
  function symbolControl(s) {
    const val = Math.max(2, s.value || 2); // (the sliders start at 2: a size of 1 traces other kernels)
    const max = Math.max(4 * val, 16);
    const range = el("input", { type: "range", id: `ctl-${s.name}`, min: "2", max: String(max), step: "1",
      value: String(val) });
    const num = el("input", { type: "number", id: `in-${s.name}`, min: "2", step: "1", value: String(val) });
    const set = (x, from) => {
      x = Math.max(2, Math.round(Number(x)));
      if (!Number.isFinite(x)) return;
      state.v[s.name] = x;
      if (from !== num) num.value = String(x);
      if (from !== range) { if (x > Number(range.max)) range.max = String(x); range.value = String(x); }
      update();
    };
    range.addEventListener("input", () => set(range.value, range));
    num.addEventListener("change", () => set(num.value, num));
    inputs[s.name] = { range, num, row: null };
    const row = el("div", { class: "ctl", id: `row-${s.name}` },
      el("label", { for: `ctl-${s.name}`, title: s.meaning, text: `${s.name}` }), range, num,
      el("span", { class: "meaning", text: s.meaning }));
    inputs[s.name].row = row;
    return row;
  }
  function select(id, label, options, value, onchange) {
    const sel = el("select", { id });
    for (const [v, t] of options) sel.append(el("option", { value: v, text: t }));
    sel.value = value;
    sel.addEventListener("change", () => { onchange(sel.value); update(); });
    return el("div", { class: "ctl" }, el("label", { for: id, text: label }), sel);
  }
  const LAYOUT_TEXT = { none: "one device", ddp: "DP ranks, DDP (states replicated)",
    fsdp: "DP ranks, FSDP2 (states sharded)", zero1: "DP ranks, ZeRO-1", zero2: "DP ranks, ZeRO-2",
    zero3: "DP ranks, ZeRO-3" };
  controls.append(
    select("precision", "precision", precisions.map((p) => [p, p]), state.precision, (x) => { state.precision = x; }),
    select("device", "device", D.devices.map((d) => [d.key, d.name]), state.device, (x) => { state.device = x; }),
    select("layout", "layout", layouts.map((l) => [l, LAYOUT_TEXT[l] || l]), state.layout, (x) => { state.layout = x; }),
    select("ac", "activation checkpointing", acs.map((a) => [a, a === "none" ? "off" : `on (--ac ${a})`]), state.ac,
      (x) => { state.ac = x; }));
  for (const s of D.symbols) controls.append(symbolControl(s));

  // ---- the numbers -------------------------------------------------------------------------
  const tables = el("div", { class: "tables" });
  app.append(tables);
  function table(title, rows) {
    const t = el("table", {}, el("caption", { text: title }));
    for (const [id, label] of rows) {
      t.append(el("tr", { id: `tr-${id}` }, el("th", { text: label }), el("td", { id: `v-${id}`, class: "num" })));
    }
    tables.append(t);
    return t;
  }
  const MEM_LABEL = { params: "parameters", grads: "gradients", optimizer: "optimizer state",
    optimizer_state: "optimizer state", master_weights: "master weights", master: "master weights",
    buffers: "buffers", inputs: "inputs", activations: "activations (saved for backward)" };
  const memTable = el("div");
  tables.append(memTable);
  table("Model FLOPs per step (report --json: flops.*)",
    [["flops-forward", "forward"], ["flops-backward", "backward"], ["flops-train", "train"]]);
  table("Roofline on the device (roofline --json; one device, fused bytes)",
    [["step", "step-time bound"], ["mfu", "MFU ceiling"]]);
  table("Activation checkpointing, the √L law (checkpoint --json: block, k_star)",
    [["law-a", "a: one block's saved bytes"], ["law-x", "x: a block's input (kept per segment)"],
     ["law-f", "f: one block's forward FLOPs (recomputed)"], ["law-kstar", "k* = √(L·x/a) blocks per segment"],
     ["law-mstar", "M(k*) = 2·√(L·a·x)"]]);
  if (D.kv) {
    table(`KV cache of the decode step at context S (serve --context S --json: kv.*; ${D.kv.precision})`,
      [["kv-token", "bytes per token (every layer)"], ["kv-sequence", "per sequence of S tokens"]]);
  }
  const msg = el("p", { id: "message", class: "note" });
  app.append(msg);

  function setText(id, text, value) {
    const c = document.getElementById(`v-${id}`);
    if (!c) return;
    c.textContent = text;
    if (value !== undefined) c.dataset.value = String(value);
  }

  // ---- the plots ---------------------------------------------------------------------------
  const plots = el("div", { class: "plots" });
  app.append(plots);
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf"];
  const made = {};
  const slots = {};  // one box per plot, in a fixed order (a plot redrawn with other series keeps its place)
  for (const id of ["memB", "memS", "step", "roofline", "law", "kv"]) {
    slots[id] = el("div", { class: "plot", id: `plot-${id}` });
    plots.append(slots[id]);
  }
  // a log axis' ticks: 0.001, 0.1, 10, 1000 (uPlot's default rounds those below 1 to 0)
  const logTicks = (u, vals) => vals.map((v) => v == null ? "" : v >= 1 ? String(Math.round(v)) : String(+v.toPrecision(1)));
  function plot(id, title, xLabel, yLabel, series, data, opts) {
    const width = Math.min(560, Math.max(320, (app.clientWidth || 1100) / 2 - 30));
    const cfg = Object.assign({
      title, width, height: 300, scales: { x: { time: false } },
      axes: [{ label: xLabel, values: opts && opts.log ? logTicks : undefined },
        { label: yLabel, size: 80, values: opts && opts.log ? logTicks : undefined }],
      series: [{ label: xLabel }].concat(series),
    }, (opts && opts.cfg) || {});
    if (made[id] && made[id].sig === JSON.stringify(series.map((s) => s.label))) {
      made[id].u.setData(data);
      return;
    }
    if (made[id]) made[id].u.destroy();
    made[id] = { u: new uPlot(cfg, data, slots[id]), sig: JSON.stringify(series.map((s) => s.label)) };
  }

  const line = (label, i, extra) => Object.assign({ label, stroke: COLORS[i % COLORS.length], width: 1.5,
    points: { show: false } }, extra || {});
  function sweep(n, hi) {  // integer points 1..hi
    const xs = [];
    const step = Math.max(1, Math.ceil(hi / n));
    for (let x = 1; x <= hi; x += step) xs.push(x);
    if (xs[xs.length - 1] !== hi) xs.push(hi);
    return xs;
  }
  function memoryPlot(id, vr, sym, dev, mb) {
    const cur = state.v[sym];
    const xs = sweep(60, Math.max(4 * cur, 8, mb ? Math.min(Math.ceil(1.25 * mb), 2 ** 20) : 0));
    const cats = Object.keys(vr.memory.categories);
    const ys = cats.map((k) => xs.map((x) => vr.memory.categories[k](sizes({ [sym]: x })) / 2 ** 30));
    const series = cats.map((k, i) => line(MEM_LABEL[k] || k, i));
    const data = [xs].concat(ys);
    if (vr.memory.peak) { series.push(line("peak", 8, { width: 2.5 })); data.push(xs.map((x) => vr.memory.peak(sizes({ [sym]: x })) / 2 ** 30)); }
    if (dev.memory) { series.push(line(`${dev.key} capacity`, 3, { dash: [6, 4] })); data.push(xs.map(() => dev.memory / 2 ** 30)); }
    plot(id, `memory by category vs ${sym} (GiB${vr.shard ? ", one rank" : ""})`, sym, "GiB", series, data);
  }
  function stepPlot(base, dev) {
    const xs = sweep(40, Math.max(4 * state.v.B, 8));
    const ys = xs.map((b) => roofline(base, dev, sizes({ B: b })).step * 1e3);
    plot("step", `step-time bound vs B on ${dev.key} (ms, roofline)`, "B", "ms", [line("step-time bound", 0)], [xs, ys]);
  }
  function rooflinePlot(base, dev, rf) {
    const pts = rf.pts.filter((p) => p.I > 0 && p.att > 0).sort((a, b) => a.I - b.I);
    if (!pts.length) return;
    const lo = Math.min(pts[0].I, 0.1), hi = Math.max(pts[pts.length - 1].I, 4 * rf.peakTrain / dev.bandwidth);
    const roofX = [];
    for (let e = Math.log10(lo); e <= Math.log10(hi) + 1e-9; e += (Math.log10(hi) - Math.log10(lo)) / 60) roofX.push(10 ** e);
    const xs = [...new Set(roofX.concat(pts.map((p) => p.I)))].sort((a, b) => a - b);
    const idx = new Map(xs.map((x, i) => [x, i]));
    const roof = xs.map((x) => roofX.includes(x) ? Math.min(rf.peakTrain, dev.bandwidth * x) / 1e12 : null);
    const fw = xs.map(() => null), bw = xs.map(() => null);
    for (const p of pts) (p.phase === "forward" ? fw : bw)[idx.get(p.I)] = p.att / 1e12;
    const dots = { paths: () => null, points: { show: true, size: 6 } };
    plot("roofline", `roofline on ${dev.key}: the model's ops (TFLOP/s vs FLOP/byte)`, "FLOP/byte", "TFLOP/s",
      [line(`roof (${base.train_key})`, 7, { spanGaps: true }), line("forward ops", 0, dots), line("backward ops", 1, dots)],
      [xs, roof, fw, bw], { log: true, cfg: { scales: { x: { time: false, distr: 3 }, y: { distr: 3 } } } });
  }
  function lawPlot(base) {
    const v = sizes(), L = v.L;
    if (!base.law || !L) return;
    const a = base.law.a(v), x = base.law.x(v);
    const ks = sweep(L, L);
    const M = ks.map((k) => (L / k * x + k * a) / 2 ** 30);
    plot("law", "checkpoint trade-off: M(k) = (L/k)·x + k·a (GiB) vs blocks per segment k", "k", "GiB",
      [line("M(k)", 2), line("no checkpointing: L·a", 3, { dash: [6, 4] })], [ks, M, ks.map(() => L * a / 2 ** 30)]);
  }

  // symcost.passes.inference.kv_cache: the cache after one decode step, B sequences of T + 1
  // tokens (T = context - 1 cached, one new), per token total / (B·context)
  function kvAt(ctx, b) {
    const v = Object.assign(sizes({ B: b }), D.kv.pinned, { T: ctx - 1, S: 1 });
    return D.kv.total(v);
  }
  function kvPlot() {
    const xs = sweep(60, Math.max(4 * state.v.S, 8));
    plot("kv", "KV cache per sequence vs context (GiB)", "context", "GiB",
      [line("KV cache, one sequence", 4)], [xs, xs.map((c) => kvAt(c, 1) / 2 ** 30)]);
  }

  // ---- one update --------------------------------------------------------------------------
  function update() {
    const v = sizes();
    for (const [name, c] of Object.entries(inputs)) {
      c.row.style.display = name === "DP" && state.layout === "none" ? "none" : "";
    }
    const vr = variant(state.precision, state.layout, state.ac);
    const base = variant(state.precision, "none", "none");
    const dev = device();
    msg.textContent = "";
    memTable.replaceChildren();
    if (!vr) {
      msg.textContent = `This page holds no trace of ${state.precision} with layout ${state.layout} and `
        + `checkpointing ${state.ac}: symcost explore ${D.model} traces the layouts it is given (--layout, --ac, --precision).`;
    } else {
      const m = memory(vr, v);
      const rows = Object.keys(vr.memory.categories).map((k) => [`mem-${k}`, MEM_LABEL[k] || k]);
      rows.push(["mem-peak", vr.shard ? "peak of one rank" : "peak (steady-state step)"]);
      if (!vr.shard) rows.push(["max-batch", `largest B under ${dev.key}'s ${human(dev.memory, "B")}`]);
      if (vr.shard) rows.push(["comm", "bytes each rank sends per step"]);
      const t = el("table", {}, el("caption", { text: vr.shard
        ? `Memory of one of DP = ${v.DP} ranks, ${vr.shard} (report --dp DP --shard ${vr.shard} --json: parallel.*)`
        : `Memory, one device (report --json: memory.*)${vr.ac ? ", every block checkpointed (--ac " + vr.ac + ")" : ""}` }));
      for (const [id, label] of rows) t.append(el("tr", { id: `tr-${id}` }, el("th", { text: label }), el("td", { id: `v-${id}`, class: "num" })));
      memTable.append(t);
      for (const k of Object.keys(vr.memory.categories)) setText(`mem-${k}`, human(m[k], "B"), m[k]);
      setText("mem-peak", m.peak == null ? "-" : human(m.peak, "B"), m.peak);
      let mb = null;
      if (!vr.shard && dev.memory) { mb = maxBatch(vr, v, dev.memory); setText("max-batch", String(mb), mb); }
      if (vr.shard) { const c = vr.memory.comm(v); setText("comm", human(c, "B"), c); }
      for (const ph of ["forward", "backward", "train"]) {
        const f = vr.flops[ph](v);
        setText(`flops-${ph}`, human(f, "FLOP"), f);
      }
      if (m.peak != null && dev.memory && m.peak > dev.memory) {
        msg.textContent = `does not fit: the peak ${human(m.peak, "B")} is above ${dev.key}'s ${human(dev.memory, "B")}`;
      }
      memoryPlot("memB", vr, "B", dev, mb);
      if ("S" in state.v) memoryPlot("memS", vr, "S", dev);
    }
    if (base && base.ops) {
      const rf = roofline(base, dev, v);
      setText("step", ms(rf.step), rf.step);
      setText("mfu", pct(rf.mfu), rf.mfu);
      stepPlot(base, dev);
      rooflinePlot(base, dev, rf);
    }
    if (base && base.law && v.L) {
      const a = base.law.a(v), x = base.law.x(v), f = base.law.f(v);
      const ks = Math.sqrt(v.L * x / a);
      setText("law-a", human(a, "B"), a);
      setText("law-x", human(x, "B"), x);
      setText("law-f", human(f, "FLOP"), f);
      setText("law-kstar", fixed(ks, 3), ks);
      const mstar = 2 * Math.sqrt(v.L * a * x);
      setText("law-mstar", human(mstar, "B"), mstar);
      lawPlot(base);
    }
    if (D.kv && v.S) {
      const one = kvAt(v.S, 1), tok = kvAt(v.S, v.B) / (v.B * v.S);
      setText("kv-token", Number.isInteger(tok) ? tok.toLocaleString("en-US") + " B" : fixed(tok, 1) + " B", tok);
      setText("kv-sequence", human(one, "B"), one);
      kvPlot();
    }
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }
  update();
})();
