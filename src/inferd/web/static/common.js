// What both pages share: the API key, fetch with it, a server-sent-events reader over fetch (the
// browser's EventSource cannot send an Authorization header), and number formats.
// Everything the server or the model sends is put into the page as text (textContent), never as HTML.
'use strict';

const inferd = (() => {
  const KEY = 'inferd-api-key';
  let onKey = null;

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = 'Bearer ' + key;
    return h;
  }

  class AuthError extends Error {}

  // fetch with the key; a 401 opens the key form and throws AuthError
  async function api(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = headers(o.headers);
    const r = await fetch(path, o);
    if (r.status === 401) {
      askKey(sessionStorage.getItem(KEY) ? 'That key was refused. API key:' : 'This server needs an API key:');
      throw new AuthError('API key needed');
    }
    return r;
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return r.status + ': ' + body.error.message;
    } catch (e) { /* not JSON */ }
    return 'HTTP ' + r.status;
  }

  function askKey(message) {
    const box = document.getElementById('key-box');
    document.getElementById('key-message').textContent = message;
    box.hidden = false;
    document.getElementById('key-input').focus();
  }

  function setupKeyForm(callback) {
    onKey = callback;
    document.getElementById('key-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const input = document.getElementById('key-input');
      sessionStorage.setItem(KEY, input.value.trim());
      input.value = '';
      document.getElementById('key-box').hidden = true;
      if (onKey) onKey();
    });
  }

  // yields {event, data} for each event of a text/event-stream response body
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut).replace(/^\r?\n\r?\n/, '');
        let event = 'message';
        const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
          else if (line.startsWith('event:')) event = line.slice(6).trim();
        }
        if (data.length) yield { event, data: data.join('\n') };
      }
    }
  }

  function ms(x) {
    if (x === null || x === undefined || !isFinite(x)) return '-';
    return x >= 100 ? Math.round(x).toString() : x.toFixed(1);
  }

  function num(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return '-';
    return x.toFixed(digits === undefined ? 1 : digits);
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  return { api, AuthError, errorText, askKey, setupKeyForm, events, ms, num, el };
})();
