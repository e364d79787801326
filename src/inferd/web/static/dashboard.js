// The live dashboard: reads /v1/engine/state/stream (server-sent events) and draws each engine.
// The stream is open only while the page is visible and not paused: a hidden tab costs the engine nothing.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const SVGNS = 'http://www.w3.org/2000/svg';
  const STEPS_SHOWN = 120;
  const engines = new Map(); // engine index -> {node, steps: Map(step -> row), finished: [], state}
  let ctl = null; // the AbortController of the open stream
  let paused = false;
  let drawPending = false;

  function status(text, state) {
    const s = $('status');
    s.textContent = text;
    s.dataset.state = state;
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue('--' + name).trim() || '#888';
  }

  function svg(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function quantile(sorted, q) {
    if (!sorted.length) return null;
    const i = (sorted.length - 1) * q, lo = Math.floor(i), hi = Math.ceil(i);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (i - lo);
  }

  function engineView(i) {
    let v = engines.get(i);
    if (!v) {
      const node = $('engine-template').content.firstElementChild.cloneNode(true);
      node.dataset.engine = String(i);
      $('engines').appendChild(node);
      v = { node, steps: new Map(), finished: [], state: null };
      engines.set(i, v);
    }
    return v;
  }

  // -- receiving ---------------------------------------------------------------------------------
  function absorb(doc) {
    $('model').textContent = doc.model + (doc.draining ? ' · draining' : '');
    for (const st of doc.engines) {
      const v = engineView(st.engine || 0);
      v.state = st;
      if (st.steps) {
        for (const row of st.steps.rows) v.steps.set(row[0], row);
        const keys = [...v.steps.keys()].sort((a, b) => a - b);
        for (const k of keys.slice(0, Math.max(0, keys.length - 240))) v.steps.delete(k);
      }
      if (st.finished) {
        v.finished.push(...st.finished.rows);
        if (v.finished.length > 256) v.finished.splice(0, v.finished.length - 256);
      }
    }
    if (!drawPending) {
      drawPending = true;
      requestAnimationFrame(() => { drawPending = false; drawAll(); });
    }
  }

  async function connect() {
    if (ctl || paused || document.hidden) return;
    const mine = new AbortController();
    ctl = mine;
    status('connecting', 'connecting');
    try {
      const r = await inferd.api('/v1/engine/state/stream?interval=0.5', { signal: mine.signal });
      if (!r.ok) throw new Error(await inferd.errorText(r));
      status('live', 'live');
      for await (const ev of inferd.events(r)) {
        const doc = JSON.parse(ev.data);
        if (ev.event === 'error') throw new Error(doc.error ? doc.error.message : 'stream error');
        absorb(doc);
      }
      throw new Error('the server closed the stream');
    } catch (e) {
      if (ctl !== mine) return; // closed on purpose
      ctl = null;
      if (e instanceof inferd.AuthError) {
        status('API key needed', 'auth');
        return;
      }
      status('disconnected (' + e.message + '): retrying', 'error');
      setTimeout(connect, 1000);
      return;
    }
  }

  function disconnect(why, state) {
    if (ctl) {
      const c = ctl;
      ctl = null;
      c.abort();
    }
    status(why, state);
  }

  // -- drawing -----------------------------------------------------------------------------------
  function drawAll() {
    for (const v of engines.values()) draw(v);
  }

  function text(node, cls, value) {
    node.querySelector('.' + cls).textContent = value;
  }

  function draw(v) {
    const st = v.state, n = v.node;
    const where = (st.model ? ' (model ' + st.model + ')' : '')
      + (st.backend ? ' (' + st.backend + ', its engine ' + st.backend_engine + ')' : '');
    if (st.dead || st.error) {
      n.classList.add('dead');
      text(n, 'engine-title', 'engine ' + (st.engine || 0) + where + ': ' + (st.dead || st.error));
      return;
    }
    n.classList.remove('dead');
    const cfg = st.config || {};
    const parts = ['engine ' + (st.engine || 0) + where];
    if (st.pid) parts.push('pid ' + st.pid);
    if (cfg.tensor_parallel_size > 1) parts.push('tensor parallel × ' + cfg.tensor_parallel_size);
    if (cfg.role) parts.push(cfg.role + ' worker');
    text(n, 'engine-title', parts.join(' · '));
    n.querySelector('.config').textContent = 'KV: ' + cfg.num_blocks + ' blocks of ' + cfg.block_size + ' tokens ('
      + cfg.dtype + '), prefix caching ' + (cfg.prefix_caching ? 'on' : 'off') + ' · max ' + cfg.max_num_seqs
      + ' sequences, ' + cfg.max_num_batched_tokens + ' tokens a step · ' + cfg.scheduling + ' batching'
      + (cfg.speculative_method ? ' · speculative: ' + cfg.speculative_method : '');
    n.dataset.step = String(st.step);
    text(n, 'step-id', String(st.step));
    text(n, 'running', String(st.num_running));
    text(n, 'waiting', String(st.num_waiting));
    const c = st.counters;
    text(n, 'hit-rate', c.prefix_hit_rate === null ? '-' : (100 * c.prefix_hit_rate).toFixed(1) + ' %');
    const tier = st.kv_tier;  // size, requests that loaded from it, bytes loaded and stored, mean load time
    text(n, 'kv-tier', tier ? (tier.bytes / 2 ** 20).toFixed(0) + ' MiB ' + tier.medium.toLowerCase() + ' · '
      + tier.hits + ' hits · ' + (tier.loaded_bytes / 2 ** 20).toFixed(0) + ' MiB in, '
      + (tier.stored_bytes / 2 ** 20).toFixed(0) + ' MiB out'
      + (tier.loads ? ' · load ' + inferd.ms(1000 * tier.load_seconds / tier.loads) + ' ms' : '') : 'off');
    const spec = st.speculative;
    text(n, 'spec-rate', spec ? (100 * spec.acceptance_rate).toFixed(1) + ' %' + acceptedByPosition(spec) : 'off');
    // where the guesses went: verified (and accepted), skipped by the cost model, cut by a grammar
    text(n, 'spec-guesses', spec ? spec.num_draft_tokens + ' verified, ' + spec.num_accepted_tokens + ' accepted'
      + (spec.num_cost_skipped_tokens ? ' · ' + spec.num_cost_skipped_tokens + ' skipped (cost)' : '')
      + (spec.num_grammar_cut_tokens ? ' · ' + spec.num_grammar_cut_tokens + ' cut (grammar)' : '')
      + (spec.num_cache_drafts ? ' · ' + spec.num_cache_drafts + ' drafts from the shared cache' : '') : 'off');
    text(n, 'preemptions', String(c.preemptions));
    drawSteps(v);
    drawKV(v);
    drawDists(v);
    drawRequests(v);
  }

  // vLLM's per-position acceptance: of the verify steps, the share whose guess 1, 2, 3 .. was accepted
  function acceptedByPosition(spec) {
    const pos = spec.accepted_per_pos || [];
    if (!spec.num_drafts || !pos.length) return '';
    return ' (by position: ' + pos.slice(0, 4).map((a) => Math.round(100 * a / spec.num_drafts)).join(' / ')
      + (pos.length > 4 ? ' ..' : '') + ' %)';
  }

  function recentSteps(v) {
    return [...v.steps.values()].sort((a, b) => a[0] - b[0]).slice(-STEPS_SHOWN);
  }

  function drawSteps(v) {
    const rows = recentSteps(v), n = v.node;
    const chart = n.querySelector('.step-chart');
    // fields: step, time, seqs, prefill, decode, recompute, preempted, kv_used, ms
    if (rows.length > 1) {
      const span = rows[rows.length - 1][1] - rows[0][1];
      let toks = 0;
      for (const r of rows.slice(1)) toks += r[3] + r[4] + r[5];
      text(n, 'tok-rate', span > 0 ? Math.round(toks / span).toString() : '-');
    }
    const ms = rows.map((r) => r[8]).sort((a, b) => a - b);
    text(n, 'step-ms', ms.length ? inferd.ms(quantile(ms, 0.5)) + ' ms' : '-');
    // a canvas, not SVG elements: a few hundred rectangles redrawn a few times a second cost the
    // browser far less as pixels than as DOM nodes (and the browser may share the engine's cores)
    const W = chart.width, H = chart.height, L = 44, R = 34, T = 10, B = 24;
    const pw = W - L - R, ph = H - T - B;
    const ctx = chart.getContext('2d');
    ctx.clearRect(0, 0, W, H);
    const maxTok = Math.max(1, ...rows.map((r) => r[3] + r[4] + r[5]));
    const maxSeq = Math.max(1, ...rows.map((r) => r[2]));
    const bw = pw / STEPS_SHOWN;
    ctx.fillStyle = '#666';
    ctx.font = '10px sans-serif';
    ctx.textAlign = 'right';
    ctx.fillText(String(maxTok), L - 4, T + 8);
    ctx.fillText('0', L - 4, T + ph);
    ctx.textAlign = 'left';
    ctx.fillText(String(maxSeq), L + pw + 4, T + 8);
    ctx.fillText(rows.length ? 'step ' + rows[0][0] : 'no steps yet', L, H - 6);
    if (rows.length) {
      ctx.textAlign = 'right';
      ctx.fillText('step ' + rows[rows.length - 1][0], L + pw, H - 6);
    }
    ctx.fillStyle = '#999';
    ctx.fillRect(L, T + ph, pw, 1);
    const colour = { prefill: cssVar('prefill'), recompute: cssVar('recompute'), decode: cssVar('decode') };
    const bars = { prefill: 0, recompute: 0, decode: 0 };
    rows.forEach((r, i) => {
      let y = T + ph;
      for (const [k, cls] of [[3, 'prefill'], [5, 'recompute'], [4, 'decode']]) {
        if (!r[k]) continue;
        const h = Math.max(1, (r[k] / maxTok) * ph);
        y -= h;
        ctx.fillStyle = colour[cls];
        ctx.fillRect(L + i * bw, y, Math.max(1, bw - 1), h);
        bars[cls]++;
      }
    });
    if (rows.length) {
      ctx.strokeStyle = cssVar('batch');
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      rows.forEach((r, i) => {
        const x = L + i * bw + bw / 2, y = T + ph - (r[2] / maxSeq) * ph;
        if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      });
      ctx.stroke();
    }
    chart.dataset.prefillBars = String(bars.prefill);
    chart.dataset.decodeBars = String(bars.decode);
    chart.dataset.recomputeBars = String(bars.recompute);
  }

  function drawKV(v) {
    const kv = v.state.kv, n = v.node, map = kv.map;
    n.querySelector('.kv-map').dataset.step = String(v.state.step);
    if (map === v.drawnMap) return;
    v.drawnMap = map;
    const canvas = n.querySelector('.kv-map');
    const W = canvas.width;
    const cell = Math.max(2, Math.min(14, Math.floor(Math.sqrt((W * 220) / Math.max(1, map.length)))));
    const cols = Math.floor(W / cell), rowsN = Math.ceil(map.length / cols);
    const H = Math.max(cell, rowsN * cell);
    if (canvas.height !== H) canvas.height = H;
    const ctx = canvas.getContext('2d');
    const colour = { '.': cssVar('kv-free'), u: cssVar('kv-used'), s: cssVar('kv-shared'), c: cssVar('kv-cached') };
    const counts = { '.': 0, u: 0, s: 0, c: 0 };
    ctx.clearRect(0, 0, W, H);
    for (let b = 0; b < map.length; b++) {
      const ch = map[b];
      counts[ch] = (counts[ch] || 0) + 1;
      ctx.fillStyle = colour[ch] || '#000';
      ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
    }
    const used = counts.u + counts.s;
    canvas.dataset.used = String(used);
    n.dataset.kvUsed = String(used);
    text(n, 'kv-used-tile', used + ' / ' + map.length);
    const legend = n.querySelector('.kv-legend');
    legend.textContent = '';
    for (const [cls, label, count] of [['kv-free', 'free', counts['.']], ['kv-used', 'in use', counts.u],
                                       ['kv-shared', 'shared', counts.s], ['kv-cached', 'cached for reuse', counts.c]]) {
      const s = inferd.el('span', 'legend ' + cls);
      s.appendChild(inferd.el('span', 'swatch'));
      s.appendChild(inferd.el('span', 'legend-label', label + ' '));
      s.appendChild(inferd.el('span', 'count', String(count)));
      legend.appendChild(s);
    }
  }

  function drawDists(v) {
    const last = v.finished.length ? v.finished[v.finished.length - 1][0] : 0;
    if (last === v.drawnFinished) return;
    v.drawnFinished = last;
    // finished fields: seq, id, prompt, output, cached, finish_reason, time, queue_ms, ttft_ms, tpot_ms, e2e_ms, preemptions
    const col = { queue: 7, ttft: 8, tpot: 9 };
    for (const fig of v.node.querySelectorAll('svg.dist')) {
      const metric = fig.dataset.metric;
      const vals = v.finished.map((r) => r[col[metric]]).filter((x) => x !== null && x !== undefined)
        .sort((a, b) => a - b);
      const title = v.node.querySelector('.dist-title[data-metric="' + metric + '"]');
      const name = { queue: 'queue time', ttft: 'TTFT', tpot: 'TPOT' }[metric];
      title.textContent = vals.length
        ? name + ' (ms) of the last ' + vals.length + ' requests: p50 ' + inferd.ms(quantile(vals, 0.5)) + ', p95 '
          + inferd.ms(quantile(vals, 0.95)) + ', p99 ' + inferd.ms(quantile(vals, 0.99))
        : name + ' (ms): no finished requests yet';
      fig.textContent = '';
      if (!vals.length) continue;
      const W = 300, H = 150, L = 8, T = 8, B = 20, pw = W - 2 * L, ph = H - T - B, bins = 24;
      const hi = Math.max(quantile(vals, 0.99) * 1.05, vals[0] + 1e-6);
      const counts = new Array(bins).fill(0);
      for (const x of vals) counts[Math.min(bins - 1, Math.floor((x / hi) * bins))]++;
      const top = Math.max(...counts);
      counts.forEach((c, i) => {
        if (!c) return;
        const h = (c / top) * ph;
        svg('rect', { x: (L + (i * pw) / bins).toFixed(1), y: (T + ph - h).toFixed(1),
                      width: (pw / bins - 1).toFixed(1), height: h.toFixed(1), class: 'bar ' + metric }, fig);
      });
      svg('line', { x1: L, x2: L + pw, y1: T + ph, y2: T + ph, class: 'axis' }, fig);
      svg('text', { x: L, y: H - 5, class: 'tick' }, fig).textContent = '0';
      svg('text', { x: L + pw, y: H - 5, class: 'tick', 'text-anchor': 'end' }, fig).textContent = inferd.ms(hi) + ' ms';
    }
  }

  function drawRequests(v) {
    const key = JSON.stringify([v.state.running, v.state.waiting.length, v.state.num_waiting]);
    if (key === v.drawnRequests) return;
    v.drawnRequests = key;
    const tbody = v.node.querySelector('table.requests tbody');
    tbody.textContent = '';
    const rows = v.state.running.map((r) => [r, r.phase]).concat(v.state.waiting.map((r) => [r, 'waiting']));
    for (const [r, phase] of rows.slice(0, 32)) {
      const tr = inferd.el('tr');
      tr.dataset.phase = phase;
      for (const x of [r.id, phase, r.prompt_tokens, r.computed_tokens, r.output_tokens, r.blocks, r.preemptions,
                       Math.round(r.age_ms)]) {
        tr.appendChild(inferd.el('td', null, String(x)));
      }
      tbody.appendChild(tr);
    }
    const more = rows.length - 32 + (v.state.num_running + v.state.num_waiting - rows.length);
    if (more > 0) {
      const tr = inferd.el('tr', 'more');
      const td = inferd.el('td', null, '… and ' + more + ' more');
      td.colSpan = 8;
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
  }

  // -- setup -------------------------------------------------------------------------------------
  inferd.setupKeyForm(connect);
  $('pause').addEventListener('click', () => {
    paused = !paused;
    $('pause').textContent = paused ? 'Resume' : 'Pause';
    if (paused) disconnect('paused', 'paused');
    else connect();
  });
  document.addEventListener('visibilitychange', () => {
    if (document.hidden) disconnect('hidden: not reading', 'hidden');
    else connect();
  });
  connect();
})();
