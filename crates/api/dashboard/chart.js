"use strict";
// Line charts on <canvas>, small enough to read: a sparkline (no axes) or a chart with a value
// axis and the time range below. Colours come from the canvas's CSS `color`, so the stylesheet
// decides them (and dark mode). Each draw records what it drew in data attributes
// (`data-points`, `data-last`), which the browser tests read.

const VmonChart = (() => {
  const AXIS_LEFT = 52;
  const AXIS_BOTTOM = 18;
  const PAD = 4;

  function prepare(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(canvas.clientWidth));
    const h = Math.max(1, Math.round(canvas.clientHeight));
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }

  function clock(unixSecs) {
    const d = new Date(unixSecs * 1000);
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  // points: [{t: unix seconds, v: number}] in time order.
  // opts: {axis: bool, min, max (null: from the data), format(v), start, end (unix seconds)}
  function draw(canvas, points, opts) {
    const o = Object.assign({ axis: false, min: 0, max: null, format: String }, opts || {});
    canvas.vmonSeries = { points, opts: o };
    canvas.dataset.points = String(points.length);
    canvas.dataset.last = points.length ? String(points[points.length - 1].v) : "";
    const { ctx, w, h } = prepare(canvas);
    const style = getComputedStyle(canvas);
    const line = style.color || "#3b82f6";
    const muted = style.getPropertyValue("--chart-muted").trim() || "#888";
    const grid = style.getPropertyValue("--chart-grid").trim() || "rgba(128,128,128,0.2)";

    const left = o.axis ? AXIS_LEFT : PAD;
    const bottom = o.axis ? AXIS_BOTTOM : PAD;
    const plotW = Math.max(1, w - left - PAD);
    const top = o.axis ? 8 : PAD;
    const plotH = Math.max(1, h - bottom - top);

    let max = o.max;
    if (max === null || max === undefined || !(max > o.min)) {
      const highest = points.reduce((m, p) => Math.max(m, p.v), o.min);
      max = highest > o.min ? highest * 1.15 : o.min + 1;
    }
    const t0 = o.start !== undefined ? o.start : points.length ? points[0].t : 0;
    const t1 = o.end !== undefined ? o.end : points.length ? points[points.length - 1].t : 1;
    const span = Math.max(1, t1 - t0);
    const x = (t) => left + ((t - t0) / span) * plotW;
    const y = (v) => top + plotH - ((Math.min(Math.max(v, o.min), max) - o.min) / (max - o.min)) * plotH;

    ctx.font = "11px system-ui, sans-serif";
    if (o.axis) {
      ctx.strokeStyle = grid;
      ctx.fillStyle = muted;
      ctx.lineWidth = 1;
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = 0; i <= 2; i++) {
        const v = o.min + ((max - o.min) * i) / 2;
        const yy = Math.round(y(v)) + 0.5;
        ctx.beginPath();
        ctx.moveTo(left, yy);
        ctx.lineTo(left + plotW, yy);
        ctx.stroke();
        ctx.fillText(o.format(v), left - 6, yy);
      }
      ctx.textBaseline = "alphabetic";
      ctx.textAlign = "left";
      ctx.fillText(clock(t0), left, h - 4);
      ctx.textAlign = "right";
      ctx.fillText(clock(t1), left + plotW, h - 4);
    }

    if (!points.length) {
      if (o.axis) {
        ctx.fillStyle = muted;
        ctx.textAlign = "center";
        ctx.fillText("no samples yet", left + plotW / 2, top + plotH / 2);
      }
      return;
    }

    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p.v)) : ctx.moveTo(x(p.t), y(p.v))));
    ctx.strokeStyle = line;
    ctx.lineWidth = o.axis ? 2 : 1.5;
    ctx.lineJoin = "round";
    ctx.stroke();

    ctx.lineTo(x(points[points.length - 1].t), top + plotH);
    ctx.lineTo(x(points[0].t), top + plotH);
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = line;
    ctx.fill();
    ctx.globalAlpha = 1;

    const last = points[points.length - 1];
    ctx.beginPath();
    ctx.arc(x(last.t), y(last.v), o.axis ? 3 : 2, 0, Math.PI * 2);
    ctx.fill();
  }

  function redraw(canvas) {
    if (canvas.vmonSeries) draw(canvas, canvas.vmonSeries.points, canvas.vmonSeries.opts);
  }

  let pending = false;
  window.addEventListener("resize", () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      document.querySelectorAll("canvas.chart, canvas.spark").forEach(redraw);
    });
  });

  return { draw, redraw };
})();
