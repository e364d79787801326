// The chat page: one conversation, streamed over the server's own /v1/chat/completions.
// The stop button aborts the fetch; the server sees the connection close and aborts the request.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const history = []; // {role, content} of the turns so far
  let model = null;
  let running = null; // the AbortController of the answer being streamed

  async function loadModel() {
    try {
      const r = await inferd.api('/v1/models');
      if (!r.ok) throw new Error(await inferd.errorText(r));
      const body = await r.json();
      model = body.data[0].id;
      $('model').textContent = model + ' · context ' + body.data[0].max_model_len + ' tokens';
    } catch (e) {
      if (!(e instanceof inferd.AuthError)) $('model').textContent = 'cannot reach the server: ' + e.message;
    }
  }

  function addMessage(role, text) {
    const box = inferd.el('div', 'msg ' + role);
    box.appendChild(inferd.el('div', 'role', role));
    const content = inferd.el('div', 'content', text);
    box.appendChild(content);
    const stats = inferd.el('div', 'stats');
    box.appendChild(stats);
    $('messages').appendChild(box);
    box.scrollIntoView({ block: 'end' });
    return { box, content, stats };
  }

  function settings() {
    const num = (id, fallback) => {
      const v = parseFloat($(id).value);
      return isFinite(v) ? v : fallback;
    };
    return { temperature: num('temperature', 0.7), top_p: num('top-p', 1),
             max_tokens: Math.max(1, Math.round(num('max-tokens', 256))) };
  }

  function busy(on) {
    $('send').disabled = on;
    $('stop').disabled = !on;
  }

  async function send(text) {
    if (running) return;
    if (!model) await loadModel();
    if (!model) return;
    history.push({ role: 'user', content: text });
    addMessage('user', text).box.dataset.state = 'done';
    const messages = [];
    const system = $('system').value.trim();
    if (system) messages.push({ role: 'system', content: system });
    messages.push(...history);
    const answer = addMessage('assistant', '');
    answer.box.dataset.state = 'waiting';
    const body = Object.assign({ model, messages, stream: true, stream_options: { include_usage: true } }, settings());
    const ctl = new AbortController();
    running = ctl;
    busy(true);
    const t0 = performance.now();
    let tFirst = null, tLast = null, deltas = 0, usage = null, finish = null, text_ = '';
    try {
      const r = await inferd.api('/v1/chat/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
        signal: ctl.signal,
      });
      if (!r.ok) throw new Error(await inferd.errorText(r));
      answer.box.dataset.state = 'streaming';
      for await (const ev of inferd.events(r)) {
        if (ev.data === '[DONE]') break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices || []) {
          // a thinking model's reasoning (--reasoning-parser), shown apart from its answer
          const thought = ch.delta && ch.delta.reasoning_content;
          if (thought) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            if (!answer.thinking) {
              answer.thinking = inferd.el('div', 'thinking', '');
              answer.box.insertBefore(answer.thinking, answer.content);
            }
            answer.thinking.appendChild(document.createTextNode(thought));
          }
          const piece = ch.delta && ch.delta.content;
          if (piece) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            deltas++;
            text_ += piece;
            answer.content.appendChild(document.createTextNode(piece));
            answer.box.scrollIntoView({ block: 'end' });
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
      }
      answer.box.dataset.state = 'done';
    } catch (e) {
      if (e.name === 'AbortError') {
        answer.box.dataset.state = 'stopped';
        finish = 'stopped';
      } else {
        answer.box.dataset.state = 'error';
        answer.box.classList.add('error');
        answer.stats.textContent = e instanceof inferd.AuthError ? 'API key needed: give it above, then send again'
          : e.message;
      }
    } finally {
      running = null;
      busy(false);
    }
    if (answer.box.dataset.state === 'error') {
      history.pop(); // the turn did not happen: the message can be sent again
      return;
    }
    history.push({ role: 'assistant', content: text_ });
    const tokens = usage ? usage.completion_tokens : deltas;
    const rate = tokens > 1 && tLast > tFirst ? (tokens - 1) / ((tLast - tFirst) / 1000) : null;
    answer.box.dataset.finishReason = finish || '';
    answer.box.dataset.tokens = String(tokens);
    answer.stats.textContent = 'TTFT ' + inferd.ms(tFirst === null ? null : tFirst - t0) + ' ms · ' + tokens
      + ' tokens · ' + inferd.num(rate) + ' tok/s · ' + (finish || '');
  }

  function setup() {
    inferd.setupKeyForm(loadModel);
    $('composer').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const text = $('prompt').value;
      if (!text.trim() || running) return;
      $('prompt').value = '';
      send(text);
    });
    $('prompt').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey) {
        ev.preventDefault();
        $('composer').requestSubmit();
      }
    });
    $('stop').addEventListener('click', () => { if (running) running.abort(); });
    $('clear').addEventListener('click', () => {
      if (running) running.abort();
      history.length = 0;
      $('messages').textContent = '';
    });
    loadModel();
  }

  setup();
})();
