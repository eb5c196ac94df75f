// lmforge chat: the page `lmforge serve` answers at /. Plain JavaScript over the server's own OpenAI API
// (GET v1/models, POST v1/chat/completions with "stream": true); no framework, no build step, nothing
// loaded from elsewhere. Model and server text is only ever put in the page as text, never as HTML.
//
// What tests (and curious people) can read: each assistant turn is an <article class="msg assistant">
// with data-state (streaming, done, stopped, error: then also class "failed", not part of the conversation), data-finish (the finish_reason) and data-chunks (the
// stream events that carried text or tool calls); window.lmforgeChat.lastRequest is the last request
// body sent (the API key is never in it).
"use strict";

(() => {
  const KEY_STORE = "lmforge-chat-api-key"; // sessionStorage: forgotten when the tab closes
  const SETTINGS_STORE = "lmforge-chat-settings"; // localStorage
  const SETTING_FIELDS = ["system", "temperature", "max-tokens", "tools"];
  const $ = (id) => document.getElementById(id);
  const hook = (window.lmforgeChat = { lastRequest: null });
  const state = {
    model: null, // the id GET v1/models lists; null until connected
    keyRequired: false,
    history: [], // the conversation as OpenAI messages, sent back on every turn (without the system prompt)
    pending: [], // tool calls of the last reply still waiting for a result: {id, name}
    controller: null, // the AbortController of the reply being streamed
    epoch: 0, // bumped by "New chat": a reply still ending belongs to the old conversation
  };

  // ---- small helpers ------------------------------------------------------------------------------

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function savedKey() {
    return sessionStorage.getItem(KEY_STORE) || "";
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (savedKey()) h.Authorization = "Bearer " + savedKey();
    return h;
  }

  class ServerError extends Error {
    constructor(status, error, where) {
      super((error && error.message) || "the request failed");
      this.status = status; // an HTTP status, or null for an error reported inside a stream
      this.param = error && error.param;
      this.code = error && error.code;
      this.where = where;
    }
    get title() {
      return this.status ? `Error · HTTP ${this.status}` : `Error ${this.where || ""}`.trim();
    }
    get details() {
      return [this.param && `parameter: ${this.param}`, this.code && `code: ${this.code}`].filter(Boolean).join(" · ");
    }
  }

  async function errorOf(response) {
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      // not JSON: the status says enough
    }
    const error = (body && body.error) || { message: `${response.status} ${response.statusText}`.trim() };
    return new ServerError(response.status, error);
  }

  function networkError(e) {
    return new ServerError(null, { message: `Cannot reach the server (${e.message}). Is lmforge serve still running?` },
      "· connection");
  }

  // ---- the conversation view ------------------------------------------------------------------------

  const messages = $("messages");
  const LABELS = { user: "You", assistant: "Assistant", tool: "Tool result", error: "Error" };

  function nearBottom() {
    return messages.scrollHeight - messages.scrollTop - messages.clientHeight < 60;
  }

  function keepInView(wasNearBottom) {
    if (wasNearBottom) messages.scrollTop = messages.scrollHeight;
  }

  function addMessage(role, text, label) {
    const stick = nearBottom();
    const article = el("article", `msg ${role}`);
    article.dataset.role = role;
    article.append(el("div", "who", label || LABELS[role]), el("div", "content", text || ""), el("div", "meta"));
    messages.append(article);
    keepInView(stick);
    return article;
  }

  function addError(error) {
    const article = addMessage("error", error.message, error.title || "Error");
    if (error.details) article.querySelector(".meta").textContent = error.details;
    return article;
  }

  function appendText(article, piece) {
    const stick = nearBottom();
    article.querySelector(".content").append(piece); // a text node: never parsed as HTML
    keepInView(stick);
  }

  function prettyArguments(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (_) {
      return text; // not JSON: shown as the model wrote it
    }
  }

  function showToolCalls(article, calls) {
    article.querySelectorAll(".tool-call").forEach((node) => node.remove());
    const meta = article.querySelector(".meta");
    for (const call of calls) {
      const box = el("div", "tool-call");
      box.setAttribute("role", "group");
      box.setAttribute("aria-label", `Tool call ${call.function.name}`);
      const head = el("div", "tool-call-head", "Tool call: ");
      head.append(el("span", "tool-name", call.function.name), el("span", "tool-id", call.id));
      box.append(head, el("pre", "tool-args", prettyArguments(call.function.arguments)));
      article.insertBefore(box, meta);
    }
  }

  function mergeToolCalls(calls, deltas) {
    // OpenAI's streaming form: the first delta of a call has its id and name, later ones add argument text.
    for (const delta of deltas) {
      const index = Number.isInteger(delta.index) ? delta.index : calls.length;
      const call = (calls[index] = calls[index] || { id: "", type: "function", function: { name: "", arguments: "" } });
      const fn = delta.function || {};
      if (delta.id) call.id = delta.id;
      if (fn.name) call.function.name += fn.name;
      if (fn.arguments) call.function.arguments += fn.arguments;
    }
  }

  // ---- settings -----------------------------------------------------------------------------------

  function loadSettings() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {};
    } catch (_) {
      // unreadable: the defaults
    }
    for (const id of SETTING_FIELDS) if (typeof saved[id] === "string") $(id).value = saved[id];
  }

  function saveSettings() {
    const values = Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value]));
    localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
  }

  function resetSettings() {
    for (const id of SETTING_FIELDS) {
      $(id).value = $(id).defaultValue;
      $(id).removeAttribute("aria-invalid");
    }
    $("settings-error").hidden = true;
    localStorage.removeItem(SETTINGS_STORE);
  }

  // The settings as request fields, or null after showing what is wrong with them. Ranges are the
  // server's to check: its 400 says what it accepts.
  function readSettings() {
    const problems = [];
    const settings = {};
    const flag = (id, problem) => {
      $(id).setAttribute("aria-invalid", String(Boolean(problem)));
      if (problem) problems.push(problem);
    };
    const system = $("system").value;
    if (system.trim()) settings.system = system;

    for (const [id, field, name, whole] of [["temperature", "temperature", "Temperature", false],
      ["max-tokens", "max_tokens", "Max tokens", true]]) {
      const input = $(id);
      const value = Number(input.value);
      if (input.validity.badInput) flag(id, `${name} is not a number.`);
      else if (input.value !== "" && whole && !Number.isInteger(value)) flag(id, `${name} must be a whole number.`);
      else {
        flag(id, null);
        if (input.value !== "") settings[field] = value;
      }
    }

    const raw = $("tools").value.trim();
    let tools = [];
    let toolsProblem = null;
    if (raw) {
      try {
        tools = JSON.parse(raw);
        if (!Array.isArray(tools) || tools.some((t) => !t || typeof t !== "object" || Array.isArray(t))) {
          toolsProblem = 'Tools must be a JSON list of tool objects, like [{"type": "function", "function": ' +
            '{"name": "read_file", "parameters": {...}}}].';
        }
      } catch (e) {
        toolsProblem = `Tools are not valid JSON: ${e.message}.`;
      }
    }
    flag("tools", toolsProblem);
    if (!toolsProblem && tools.length) settings.tools = tools;

    $("settings-error").hidden = !problems.length;
    $("settings-error").textContent = problems.join("\n");
    if (!problems.length) return settings;
    $("settings").open = true;
    addError({ title: "Error · settings (nothing was sent)", message: problems.join("\n") });
    return null;
  }

  // ---- connecting, and the API key ----------------------------------------------------------------

  function showNotice(text) {
    $("notice").hidden = !text;
    $("notice").textContent = text || "";
  }

  function askKey(reason, refusal) {
    state.model = null; // nothing can be sent until the server takes a key
    $("input").disabled = true;
    updateButtons();
    showKeyForm(reason, refusal);
  }

  function showKeyForm(reason, refusal) {
    $("key-reason").textContent = reason;
    $("key-error").hidden = !refusal;
    $("key-error").textContent = refusal || "";
    $("key-form").hidden = false;
    $("key-input").value = "";
    $("key-input").focus();
  }

  async function connect() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (e) {
      $("model").textContent = "not connected";
      showNotice(networkError(e).message + " Reload the page to try again.");
      return;
    }
    if (response.status === 401) {
      state.keyRequired = true;
      const error = await errorOf(response);
      $("model").textContent = "API key needed";
      askKey("This server needs an API key (the one lmforge serve was started with).",
        savedKey() ? `The server refused this key: ${error.message}` : null);
      return;
    }
    if (!response.ok) {
      const error = await errorOf(response);
      showNotice(`${error.title}: ${error.message}`);
      return;
    }
    const card = ((await response.json()).data || [])[0];
    if (!card) {
      showNotice("The server lists no model.");
      return;
    }
    showNotice(null);
    state.model = card.id;
    $("model").textContent = card.context_length ? `${card.id} · context ${card.context_length} tokens` : card.id;
    document.title = `${card.id} · lmforge chat`;
    $("key-form").hidden = true;
    $("change-key").hidden = !state.keyRequired;
    $("input").disabled = false;
    updateButtons();
    $("input").focus();
  }

  // ---- sending and streaming ------------------------------------------------------------------------

  function updateButtons() {
    $("send").disabled = Boolean(state.controller) || !state.model;
    $("stop").disabled = !state.controller;
    const call = state.pending[0];
    $("as-tool-label").hidden = !call;
    $("as-tool-call").textContent = call ? `${call.name} (${call.id})` : "";
  }

  function submit() {
    if (state.controller || !state.model) return;
    const text = $("input").value;
    if (!text.trim()) return;
    const settings = readSettings();
    if (!settings) return;
    $("input").value = "";
    const call = $("as-tool").checked ? state.pending[0] : null;
    const message = call ? { role: "tool", tool_call_id: call.id, content: text } : { role: "user", content: text };
    const view = call ? addMessage("tool", text, `Tool result · ${call.name}`) : addMessage("user", text);
    state.pending = call ? state.pending.slice(1) : []; // a user message leaves the calls unanswered
    state.history.push(message);
    // The request failed (before any reply, or during one: a server error, a dropped connection): as if it was
    // never sent, so that sending it again retries it.
    const undo = (note = "not sent: see the error below") => {
      state.history.splice(state.history.indexOf(message), 1);
      if (call) state.pending.unshift(call);
      view.classList.add("failed");
      view.querySelector(".meta").textContent = note;
      if (!$("input").value) $("input").value = text;
      updateButtons();
    };
    updateButtons();
    if (call && state.pending.length) return; // the model answers once every call has its result
    reply(settings, undo);
  }

  const DONE = Symbol("done");

  async function* serverSentEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
        let end;
        while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
          const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
          if (data === "[DONE]") {
            yield DONE;
            return;
          }
          if (data) yield JSON.parse(data);
        }
        if (done) return;
      }
    } finally {
      reader.cancel().catch(() => {}); // a reply left early (an error event, a stop) closes its connection
    }
  }

  function finish(view, status, out) {
    view.dataset.state = status;
    view.dataset.finish = out.finish || "";
    view.removeAttribute("aria-busy");
    view.querySelector(".content").normalize();
    const tokens = out.usage ? `${out.usage.completion_tokens} tokens` : null;
    const why = {
      stopped: "stopped by you",
      error: "failed: interrupted by the error below; not part of the conversation",
    }[status] || { length: "cut at the max tokens limit", tool_calls: "tool call" }[out.finish];
    view.querySelector(".meta").textContent = [why, tokens].filter(Boolean).join(" · ");
  }

  async function reply(settings, undo) {
    const body = {
      model: state.model, messages: [...state.history], stream: true, stream_options: { include_usage: true },
    };
    if (settings.system) body.messages.unshift({ role: "system", content: settings.system });
    for (const field of ["temperature", "max_tokens", "tools"]) if (field in settings) body[field] = settings[field];
    hook.lastRequest = JSON.parse(JSON.stringify(body));

    const epoch = state.epoch;
    const controller = (state.controller = new AbortController());
    updateButtons();
    const view = addMessage("assistant", "");
    view.dataset.state = "streaming";
    view.dataset.chunks = "0";
    view.setAttribute("aria-busy", "true");
    const out = { text: "", calls: [], finish: null, usage: null, chunks: 0 };
    let started = false;
    let failed = false;
    try {
      let response;
      try {
        response = await fetch("v1/chat/completions", {
          method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
        });
      } catch (e) {
        if (controller.signal.aborted) throw e;
        throw networkError(e);
      }
      if (!response.ok) {
        const error = await errorOf(response);
        if (response.status === 401) {
          askKey("This server needs an API key.", `The server refused the key: ${error.message}`);
        }
        throw error;
      }
      started = true;
      let complete = false;
      for await (const event of serverSentEvents(response.body)) {
        if (event === DONE) {
          complete = true;
          break;
        }
        if (event.error) throw new ServerError(null, event.error, "· during the reply");
        if (event.usage) out.usage = event.usage;
        const choice = (event.choices || [])[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.content) {
          out.text += delta.content;
          appendText(view, delta.content);
          out.chunks += 1;
        }
        if (delta.tool_calls) {
          mergeToolCalls(out.calls, delta.tool_calls);
          showToolCalls(view, out.calls);
          out.chunks += 1;
        }
        if (choice.finish_reason) out.finish = choice.finish_reason;
        view.dataset.chunks = String(out.chunks);
      }
      if (!complete) {
        throw new ServerError(null, { message: "The connection closed before the reply ended." }, "· connection");
      }
      finish(view, "done", out);
    } catch (e) {
      if (controller.signal.aborted) {
        finish(view, "stopped", out);
      } else {
        const error = e instanceof ServerError ? e : new ServerError(null, { message: String(e.message || e) });
        failed = true;
        if (started || epoch !== state.epoch) {
          // What the reply wrote before it failed stays in sight, but is not sent back as if the model had
          // said it; nor is the message it answered, which goes back to the input box to be sent again.
          finish(view, "error", out);
          view.classList.add("failed");
          if (epoch === state.epoch) undo("sent, but its reply failed (see the error below): not part of the conversation");
        } else {
          view.remove();
          undo();
        }
        if (epoch === state.epoch) addError(error);
      }
    } finally {
      if (state.controller === controller) state.controller = null;
      updateButtons();
    }
    if (failed || epoch !== state.epoch || (!out.text && !out.calls.length)) return;
    const message = { role: "assistant", content: out.text || null };
    if (out.calls.length) message.tool_calls = out.calls;
    state.history.push(message);
    state.pending = out.calls.map((call) => ({ id: call.id, name: call.function.name }));
    $("as-tool").checked = true;
    updateButtons();
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.epoch += 1;
    state.history = [];
    state.pending = [];
    messages.replaceChildren();
    updateButtons();
    $("input").focus();
  }

  // ---- wiring ---------------------------------------------------------------------------------------

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  const stop = () => state.controller && state.controller.abort();
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => e.key === "Escape" && stop());
  $("new-chat").addEventListener("click", newChat);
  $("change-key").addEventListener("click", () => showKeyForm("Enter the server's API key.", null));
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (!/^[\x21-\x7e]+$/.test(key)) { // what an HTTP header can carry
      showKeyForm($("key-reason").textContent, "An API key is printable ASCII text without spaces.");
      return;
    }
    sessionStorage.setItem(KEY_STORE, key);
    $("key-error").hidden = true;
    connect();
  });
  $("settings-form").addEventListener("input", saveSettings);
  $("reset-settings").addEventListener("click", resetSettings);

  loadSettings();
  if (window.matchMedia("(min-width: 50rem)").matches) $("settings").open = true; // beside the chat when it fits
  updateButtons();
  connect();
})();
