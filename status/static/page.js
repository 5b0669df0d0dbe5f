/* Ferry status page: polls status/all, keeps a rolling 5-minute window, draws its own charts.
 *
 * No libraries and nothing from the internet: charts are plain <canvas> drawing. Every value
 * from the agent reaches the page through textContent (never innerHTML), because topic names
 * and samples come from clients.
 *
 * Query parameters: ?refresh=MS (poll interval, default 1500, 200..60000).
 */
(function () {
  "use strict";

  var WINDOW_S = 300;
  var params = new URLSearchParams(window.location.search);
  var refreshMs = clamp(parseInt(params.get("refresh") || "1500", 10) || 1500, 200, 60000);

  var RATE_SERIES = [
    { name: "socket", label: "accepted · socket", color: "#2563eb", get: function (p) { return src(p, "socket"); } },
    { name: "http", label: "accepted · HTTP", color: "#0d9488", get: function (p) { return src(p, "http"); } },
    { name: "spool", label: "accepted · spool", color: "#d97706", get: function (p) { return src(p, "spool"); } },
    { name: "replay", label: "accepted · replay", color: "#64748b", optional: true, get: function (p) { return src(p, "replay"); } },
    { name: "delivered", label: "delivered", color: "#16a34a", get: function (p) { return p.delivered; } },
    { name: "discarded", label: "discarded", color: "#dc2626", dash: [6, 4], get: function (p) { return p.discarded; } },
    { name: "rejected", label: "rejected", color: "#9333ea", dash: [2, 3], get: function (p) { return p.rejected; } }
  ];
  var DEPTH_SERIES = [
    { name: "buffered", label: "buffered messages", color: "#4f46e5", fill: "rgba(79, 70, 229, 0.14)", get: function (p) { return p.buffer_messages; } }
  ];

  var points = [];          // cumulative counters per poll, oldest first (see pointOf)
  var openSamples = {};     // which sample lists the reader expanded, kept across re-renders
  var state = {             // exposed for people debugging in the console (and for tests)
    polls: 0, errors: 0, lastError: null, renderError: null, doc: null, points: points,
    charts: { rate: null, depth: null }, refreshMs: refreshMs, fmtTick: fmtTick
  };
  window.ferryStatus = state;

  function clamp(v, lo, hi) { return Math.max(lo, Math.min(hi, v)); }
  function src(p, name) { return (p.accepted_by_source && p.accepted_by_source[name]) || 0; }

  // -- formatting ----------------------------------------------------------------------------
  function fmtCount(n) {
    if (n === null || n === undefined) return "–";
    var a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
    return String(Math.round(n));
  }
  function fmtInt(n) {
    if (n === null || n === undefined) return "–";
    return Math.round(n).toLocaleString("en-US");
  }
  function fmtRate(r) {
    if (r === null || r === undefined || !isFinite(r)) return "–";
    if (r === 0) return "0";
    if (Math.abs(r) < 10) return r.toFixed(1);
    return fmtCount(r);
  }
  function fmtAxis(v) {
    if (v === 0) return "0";
    if (Math.abs(v) < 10) return String(parseFloat(v.toFixed(2)));
    return fmtCount(v);
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i === 0 ? String(Math.round(b)) : b.toFixed(b >= 100 ? 0 : 1)) + " " + units[i];
  }
  function fmtAge(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  function fmtUptime(s) {
    s = Math.floor(s);
    var d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
    var m = Math.floor(s % 3600 / 60), sec = s % 60;
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    if (m) return m + "m " + sec + "s";
    return sec + "s";
  }
  function fmtClock(t) {
    if (!t) return "–";
    var d = new Date(t * 1000);
    return d.toLocaleTimeString("en-GB", { hour12: false });
  }
  function fmtAgo(t, now) {
    if (!t) return "never";
    return fmtAge(Math.max(0, now - t)) + " ago";
  }

  // -- DOM helpers ---------------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }
  function setText(id, text) { var e = $(id); if (e) e.textContent = text; }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function td(text, cls) { return el("td", cls, text); }
  function emptyRow(tbody, cols, text) {
    var tr = el("tr");
    var cell = td(text, "empty");
    cell.colSpan = cols;
    tr.appendChild(cell);
    tbody.appendChild(tr);
  }
  function replaceRows(table, rows) {
    var tbody = table.tBodies[0];
    var fresh = document.createElement("tbody");
    rows(fresh);
    table.replaceChild(fresh, tbody);
  }

  // -- data ----------------------------------------------------------------------------------
  function pointOf(doc) {
    return {
      time: doc.time,
      accepted_by_source: doc.totals.accepted_by_source,
      delivered: doc.totals.delivered,
      discarded: doc.totals.discarded,
      rejected: doc.totals.rejected,
      buffer_messages: doc.queues.buffer.messages,
      buffer_bytes: doc.queues.buffer.bytes
    };
  }

  function addPoints(doc) {
    if (doc.history && points.length === 0) {
      doc.history.forEach(function (p) { if (p.time < doc.time - 0.5) points.push(p); });
    }
    var last = points[points.length - 1];
    if (!last || doc.time > last.time) points.push(pointOf(doc));
    var cutoff = doc.time - WINDOW_S - 15;
    while (points.length > 2 && points[0].time < cutoff) points.shift();
  }

  // Rate between consecutive points; a counter that went down (agent restarted) counts as 0.
  function rates(get) {
    var out = [];
    for (var i = 1; i < points.length; i++) {
      var dt = points[i].time - points[i - 1].time;
      if (dt <= 0) continue;
      out.push([points[i].time, Math.max(0, get(points[i]) - get(points[i - 1])) / dt]);
    }
    return out;
  }
  function levels(get) { return points.map(function (p) { return [p.time, get(p)]; }); }

  // The current rate over about the last 5 seconds (smoother than the last poll alone).
  function recentRate(get) {
    if (points.length < 2) return null;
    var last = points[points.length - 1];
    var base = points[points.length - 2];
    for (var i = points.length - 2; i >= 0; i--) {
      if (last.time - points[i].time > 5.5) break;
      base = points[i];
    }
    var dt = last.time - base.time;
    return dt > 0 ? Math.max(0, get(last) - get(base)) / dt : null;
  }

  // -- charts --------------------------------------------------------------------------------
  function niceMax(v) {
    if (!(v > 0)) return 1;
    var p = Math.pow(10, Math.floor(Math.log10(v)));
    var steps = [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * p >= v) return steps[i] * p;
    return 10 * p;
  }

  // A fresh agent has little history: zoom in rather than draw everything in the last pixels.
  var WINDOWS = [[30, 5], [60, 10], [120, 20], [180, 30], [300, 60]];  // [seconds, tick]

  // A time-axis label, whole units only: "-40s", "-1m40s", "-2m" (never "-1.666m").
  function fmtTick(ago) {
    if (ago === 0) return "now";
    if (ago < 60) return "-" + ago + "s";
    var m = Math.floor(ago / 60), sec = Math.round(ago - 60 * m);
    return "-" + m + "m" + (sec ? sec + "s" : "");
  }
  function chartWindow(now) {
    var span = points.length ? now - points[0].time : 0;
    for (var i = 0; i < WINDOWS.length; i++) if (WINDOWS[i][0] >= span) return WINDOWS[i];
    return WINDOWS[WINDOWS.length - 1];
  }
  function fmtWindow(s) { return s < 60 ? s + " seconds" : s === 60 ? "minute" : s / 60 + " minutes"; }

  function drawChart(canvas, series, now, win) {
    var dpr = window.devicePixelRatio || 1;
    var w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return null;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    var left = 56, right = w - 12, top = 10, bottom = h - 24;
    var span = win[0], tick = win[1];
    var tmin = now - span;
    var ymax = 0;
    series.forEach(function (s) {
      s.data.forEach(function (d) { if (d[0] >= tmin && d[1] > ymax) ymax = d[1]; });
    });
    ymax = niceMax(ymax);
    function X(t) { return left + (right - left) * (t - tmin) / span; }
    function Y(v) { return bottom - (bottom - top) * v / ymax; }

    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.strokeStyle = "#e6eaef";
    ctx.fillStyle = "#6b7685";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (var i = 0; i <= 4; i++) {
      var v = ymax * i / 4, y = Math.round(Y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(right, y); ctx.stroke();
      ctx.fillText(fmtAxis(v), left - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    var ticks = [];
    for (var ago = 0; ago <= span; ago += tick) {
      var x = Math.round(X(now - ago)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
      ticks.push(fmtTick(ago));
      ctx.fillText(ticks[ticks.length - 1], x, bottom + 6);
    }

    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top - 2, right - left, bottom - top + 4);
    ctx.clip();
    series.forEach(function (s) {
      var d = s.data.filter(function (p) { return p[0] >= tmin - 10; });
      if (!d.length) return;
      if (s.fill) {
        ctx.beginPath();
        ctx.moveTo(X(d[0][0]), bottom);
        d.forEach(function (p) { ctx.lineTo(X(p[0]), Y(p[1])); });
        ctx.lineTo(X(d[d.length - 1][0]), bottom);
        ctx.closePath();
        ctx.fillStyle = s.fill;
        ctx.fill();
      }
      ctx.beginPath();
      d.forEach(function (p, j) {
        if (j === 0) ctx.moveTo(X(p[0]), Y(p[1])); else ctx.lineTo(X(p[0]), Y(p[1]));
      });
      ctx.setLineDash(s.dash || []);
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      ctx.strokeStyle = s.color;
      ctx.stroke();
      ctx.setLineDash([]);
    });
    ctx.restore();
    return {
      ymax: ymax,
      window: span,
      ticks: ticks,
      plot: { left: left, right: right, top: top, bottom: bottom },
      series: series.map(function (s) {
        return { name: s.name, color: s.color, points: s.data.length,
                 last: s.data.length ? s.data[s.data.length - 1][1] : null };
      })
    };
  }

  function legend(id, series, format) {
    var box = $(id);
    box.textContent = "";
    series.forEach(function (s) {
      var item = el("span");
      var key = el("span", "key");
      key.style.background = s.color;
      item.appendChild(key);
      item.appendChild(document.createTextNode(s.label + " "));
      // Rates: the same ~5 s average as the tiles; levels: the latest value.
      var last = s.current !== undefined ? s.current :
        s.data.length ? s.data[s.data.length - 1][1] : null;
      item.appendChild(el("b", null, format(last)));
      box.appendChild(item);
    });
  }

  function drawCharts(doc) {
    var now = doc.time;
    var replayUsed = points.some(function (p) { return src(p, "replay") > 0; });
    var rs = RATE_SERIES.filter(function (s) { return !s.optional || replayUsed; }).map(function (s) {
      return { name: s.name, label: s.label, color: s.color, dash: s.dash, data: rates(s.get),
               current: recentRate(s.get) };
    });
    var ds = DEPTH_SERIES.map(function (s) {
      return { name: s.name, label: s.label, color: s.color, fill: s.fill, data: levels(s.get) };
    });
    var win = chartWindow(now);
    state.charts.rate = drawChart($("rate-chart"), rs, now, win);
    state.charts.depth = drawChart($("depth-chart"), ds, now, win);
    setText("rate-window", "· last " + fmtWindow(win[0]));
    setText("depth-window", "· messages waiting, last " + fmtWindow(win[0]));
    legend("rate-legend", rs, function (v) { return fmtRate(v) + "/s"; });
    legend("depth-legend", ds, fmtInt);
  }

  // -- sections ------------------------------------------------------------------------------
  function renderHeader(doc) {
    var info = doc.info;
    setText("hostname", info.hostname);
    setText("version", info.version);
    setText("uptime", fmtUptime(info.uptime_seconds));
    setText("phase", info.phase + (info.ready ? "" : " (not ready: " + info.ready_reason + ")"));
    setText("pid", info.pid);
    document.title = "Ferry · " + info.hostname + " · " + doc.health.status.toUpperCase();
    var badge = $("health");
    badge.className = "badge " + doc.health.status;
    badge.textContent = doc.health.status;
    setText("updated", "updated " + fmtClock(doc.time));
    var list = $("problems");
    list.textContent = "";
    doc.health.problems.forEach(function (p) {
      var li = el("li", p.level);
      li.appendChild(el("b", null, p.level));
      li.appendChild(document.createTextNode(p.message));
      list.appendChild(li);
    });
  }

  function renderTiles(doc) {
    ["socket", "http", "spool"].forEach(function (name) {
      setText("rate-" + name, fmtRate(recentRate(function (p) { return src(p, name); })));
    });
    setText("rate-delivered", fmtRate(recentRate(function (p) { return p.delivered; })));
    var b = doc.queues.buffer;
    setText("buffer-messages", fmtInt(b.messages));
    setText("buffer-bytes", fmtBytes(b.bytes));
    setText("buffer-used", b.used_fraction === null ? "" :
      (b.used_fraction * 100).toFixed(1) + "% of " + fmtBytes(b.max_bytes) + " used" +
      (b.full ? " — FULL" : ""));
    setText("buffer-oldest", fmtAge(b.oldest_age_seconds));
    // RSS counts the buffer file's resident pages; the agent's own memory is shown apart.
    var m = doc.info.memory;
    setText("memory-own", m.own_bytes === null ? "–" : fmtBytes(m.own_bytes));
    setText("memory-mapped", m.rss_bytes === null ? "" :
      "RSS " + fmtBytes(m.rss_bytes) + ", of it " + fmtBytes(m.buffer_mapped_bytes) +
      " buffer pages (reclaimable)");
    $("buffer-oldest").parentNode.classList.toggle(
      "alert", (b.oldest_age_seconds || 0) >= doc.health.thresholds.oldest_warning_seconds);
  }

  var MAX_TOPIC_ROWS = 500;

  function renderTopics(doc) {
    var rows = doc.topics.slice().sort(function (a, b) {
      var ha = a.stuck ? -1 : a.buffered > 0 || a.last_error ? 0 : 1;
      var hb = b.stuck ? -1 : b.buffered > 0 || b.last_error ? 0 : 1;
      return ha - hb || (a.topic < b.topic ? -1 : a.topic > b.topic ? 1 : 0);
    });
    setText("topics-note", rows.length > MAX_TOPIC_ROWS ?
      "· first " + MAX_TOPIC_ROWS + " of " + rows.length + " (all in status/topics)" :
      "· " + rows.length);
    replaceRows($("topics"), function (tbody) {
      if (!rows.length) { emptyRow(tbody, 9, "no messages yet"); return; }
      rows.slice(0, MAX_TOPIC_ROWS).forEach(function (t) {
        var tr = el("tr", t.buffered > 0 && (t.oldest_age_seconds || 0) > 10 ? "hot" : null);
        tr.dataset.topic = t.topic;
        tr.appendChild(td(t.topic, "mono"));
        tr.appendChild(td(fmtInt(t.accepted), "num"));
        tr.appendChild(td(fmtInt(t.delivered), "num"));
        tr.appendChild(td(fmtInt(t.buffered), "num"));
        tr.appendChild(td(t.buffered ? fmtAge(t.oldest_age_seconds) : "–", "num"));
        tr.appendChild(td(fmtInt(t.discarded), "num"));
        tr.appendChild(td(fmtInt(t.delivery_failures), "num"));
        var err = td("", t.last_error || t.stuck ? "err" : null);
        if (t.stuck) {
          // Why the topic does not deliver: the error it is retried on, since when.
          err.appendChild(document.createTextNode(
            "STUCK: " + t.stuck.error + (t.stuck.cluster ? " @" + t.stuck.cluster : "")));
          if (t.stuck.detail) err.appendChild(el("div", "sub", t.stuck.detail));
          err.appendChild(el("div", "sub", fmtInt(t.stuck.failures) + " failed sends" +
            (t.stuck.since ? " in " + fmtAge(Math.max(0, doc.time - t.stuck.since)) : "") +
            (t.stuck.operator ? "; needs an operator" : "")));
        } else if (t.last_error) {
          err.appendChild(document.createTextNode(
            t.last_error.error + (t.last_error.cluster ? " @" + t.last_error.cluster : "")));
          if (t.last_error.detail) err.appendChild(el("div", "sub", t.last_error.detail));
          if (t.last_error.time) err.appendChild(el("div", "sub", fmtAgo(t.last_error.time, doc.time)));
        } else {
          err.textContent = "–";
        }
        tr.appendChild(err);
        tr.appendChild(td(t.clusters_used.length ? t.clusters_used.map(function (c) {
          return c + (t.clusters_used.length > 1 ? " (" + fmtCount(t.delivered_by_cluster[c]) + ")" : "");
        }).join(", ") : "–"));
        tbody.appendChild(tr);
      });
    });
  }

  function renderClusters(doc) {
    replaceRows($("clusters"), function (tbody) {
      if (!doc.clusters.length) { emptyRow(tbody, 9, "no cluster configured"); return; }
      doc.clusters.forEach(function (c) {
        var tr = el("tr");
        tr.dataset.cluster = c.name;
        var name = td(c.name);
        if (c.bootstrap_servers) name.appendChild(el("div", "sub mono", c.bootstrap_servers));
        tr.appendChild(name);
        var state = c.state === "unknown" ? td("unknown", "unknown-state") :
          c.state === "up" ? td("up", "up") : td("DOWN", "down");
        if (c.state === "down" && c.reason) state.appendChild(el("div", "sub", c.reason));
        (c.unreachable_brokers || []).forEach(function (b) {
          state.appendChild(el("div", "sub", "broker " + b.node + " (" + b.address +
            ") unreachable for " + fmtAge(Math.max(0, doc.time - b.since)) + "; waiting: " +
            (b.partitions.join(", ") || "none")));
        });
        if (c.state !== "up" && c.state_since) {
          state.appendChild(el("div", "sub", "for " + fmtAge(Math.max(0, doc.time - c.state_since))));
        }
        tr.appendChild(state);
        tr.appendChild(td(c.brokers_up === null ? "–" : c.brokers_up, "num"));
        tr.appendChild(td(fmtInt(c.in_flight), "num"));
        tr.appendChild(td(fmtInt(c.delivered), "num"));
        var failures = td(fmtInt(c.delivery_failures), "num");
        if (c.client_errors) {
          failures.appendChild(el("div", "sub", fmtInt(c.client_errors) + " client errors" +
            (c.last_client_error ? ": " + c.last_client_error : "")));
        }
        tr.appendChild(failures);
        tr.appendChild(td(fmtAge(c.latency.p50_seconds), "num"));
        tr.appendChild(td(fmtAge(c.latency.p99_seconds), "num"));
        tr.appendChild(td(fmtAge(c.latency.mean_seconds), "num"));
        tbody.appendChild(tr);
      });
    });
  }

  function renderSpool(doc) {
    var s = doc.spool;
    setText("spool-pending", s.files_pending === null ? "–" : fmtInt(s.files_pending));
    setText("spool-ingested", fmtInt(s.files_ingested));
    var reasons = Object.keys(s.quarantined_by_reason).map(function (r) {
      return r + " " + s.quarantined_by_reason[r];
    });
    setText("spool-quarantined", fmtInt(s.files_quarantined) +
      (reasons.length ? " (" + reasons.join(", ") + ")" : ""));
    setText("spool-accepted", fmtInt(s.messages_accepted));
    // Re-published names (retried Spark tasks): "diverged" means records may repeat.
    setText("spool-repeated", fmtInt(s.files_duplicate) + " duplicate, " +
      fmtInt(s.files_extended) + " extended (" + fmtInt(s.records_skipped) +
      " records skipped), " + fmtInt(s.files_diverged) + " diverged");
    var deferred = Object.keys(s.batches_deferred_by_reason).map(function (r) {
      return r + " " + s.batches_deferred_by_reason[r];
    });
    setText("spool-paused", (s.paused ? "yes, waiting for room in the buffer" : "no") +
      (deferred.length ? " (batches deferred: " + deferred.join(", ") + ")" : ""));
  }

  function renderTransactions(doc) {
    var x = doc.transactions;
    setText("txn-committed", fmtInt(x.committed) + (x.fenced ? " (FENCED: exactly-once topics stopped)" : ""));
    var reasons = Object.keys(x.aborted_by_reason).map(function (r) {
      return r + " " + x.aborted_by_reason[r];
    });
    setText("txn-aborted", fmtInt(x.aborted) + (reasons.length ? " (" + reasons.join(", ") + ")" : ""));
    setText("txn-latency", fmtAge(x.latency.p50_seconds) + " / " + fmtAge(x.latency.p99_seconds));
    // Per topic: how far behind now the newest committed message was accepted.
    setText("txn-progress", x.progress.length ? x.progress.map(function (p) {
      return p.topic + " " + (p.committed_up_to === null ? "–" :
        fmtAge(Math.max(doc.time - p.committed_up_to, 0)) + " ago");
    }).join(", ") : "no exactly-once topic");
  }

  function sampleText(sample) {
    var parts = [];
    Object.keys(sample).forEach(function (k) {
      if (k === "time") return;
      var v = sample[k];
      parts.push(k + "=" + (typeof v === "string" ? v : JSON.stringify(v)));
    });
    return parts.join("  ");
  }

  function renderDiscards(doc) {
    var d = doc.discards;
    setText("discards-note", "· " + fmtInt(d.discarded) + " discarded, " + fmtInt(d.rejected) +
      " rejected, " + fmtInt(d.delivery_failures) + " delivery errors (retried)");
    replaceRows($("discards"), function (tbody) {
      if (!d.groups.length) { emptyRow(tbody, 5, "nothing discarded, rejected or failed"); return; }
      d.groups.forEach(function (g) {
        var key = g.kind + "/" + g.reason;
        var tr = el("tr");
        tr.dataset.kind = g.kind;
        tr.dataset.reason = g.reason;
        tr.appendChild(td(g.kind, "kind-" + g.kind));
        tr.appendChild(td(g.reason, "mono"));
        tr.appendChild(td(fmtInt(g.count), "num"));
        tr.appendChild(td(g.last_time ? fmtAgo(g.last_time, doc.time) : "–"));
        var cell = td();
        if (g.samples.length) {
          var det = el("details");
          det.open = !!openSamples[key];
          det.addEventListener("toggle", function () { openSamples[key] = det.open; });
          det.appendChild(el("summary", null, g.samples.length + " recent"));
          var ul = el("ul", "samples");
          g.samples.forEach(function (s) {
            var li = el("li");
            li.appendChild(el("span", "when", fmtClock(s.time)));
            li.appendChild(el("span", "mono", sampleText(s)));
            ul.appendChild(li);
          });
          det.appendChild(ul);
          cell.appendChild(det);
        } else {
          cell.textContent = "–";
        }
        tr.appendChild(cell);
        tbody.appendChild(tr);
      });
    });
  }

  function render(doc) {
    renderHeader(doc);
    renderTiles(doc);
    drawCharts(doc);
    renderTopics(doc);
    renderClusters(doc);
    renderSpool(doc);
    renderTransactions(doc);
    renderDiscards(doc);
  }

  // -- polling -------------------------------------------------------------------------------
  function showError(err) {
    state.errors++;
    state.lastError = String(err);
    var banner = $("banner");
    banner.hidden = false;
    banner.textContent = "Cannot reach Ferry (" + String(err) + ") at " +
      new Date().toLocaleTimeString("en-GB", { hour12: false }) + "; retrying every " +
      (refreshMs / 1000) + " s. The figures below are from " +
      (state.doc ? fmtClock(state.doc.time) : "nowhere yet") + ".";
    var badge = $("health");
    badge.className = "badge unknown";
    badge.textContent = "unreachable";
  }

  function poll() {
    var url = "status/all" + (points.length === 0 ? "?history=1" : "");
    fetch(url, { cache: "no-store", headers: { "Accept": "application/json" } })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(function (doc) {
        state.doc = doc;
        addPoints(doc);
        $("banner").hidden = true;
        try {
          render(doc);
          state.renderError = null;
        } catch (e) {
          // A page bug, not a connection problem: say so, keep polling.
          state.renderError = String(e);
          console.error(e);
          var banner = $("banner");
          banner.hidden = false;
          banner.textContent = "This page failed to show the agent's answer: " + String(e);
        }
        state.polls++;
      })
      .catch(showError)
      .then(function () { window.setTimeout(poll, refreshMs); });
  }

  window.addEventListener("resize", function () { if (state.doc) drawCharts(state.doc); });
  poll();
})();
