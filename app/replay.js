// The race replay: a finished race is already on the page, one chunk per forward pass in each lane, so replaying
// it needs no model and slows nothing: it only shows the first k chunks of every lane (k forward passes, the
// same k in all lanes: one clock), and recomputes each lane's two big numbers from the chunks shown, by the
// definitions of app/render.py's lane_score_html. Gradio replaces a pane's HTML on every update; a
// MutationObserver re-applies the view, and a new race (a lane not finished) returns to the live view.
(function () {
  if (window.marsReplay) return;
  const LANES = ["ar", "verify", "mars"];
  const state = { pos: null, playing: false, timer: null };

  const $ = (sel) => document.querySelector(sel);
  const texts = () => LANES.map((l) => $("#" + l + "-pane .race-text")).filter(Boolean);
  const chunksOf = (t) => Array.from(t.children).filter((c) => c.classList.contains("chunk"));
  const total = () => Math.max(0, ...texts().map((t) => chunksOf(t).length));
  const finished = () => {
    const ts = texts();
    return ts.length > 0 && ts.every((t) => t.dataset.finished === "1") && total() > 0;
  };
  const delay = () => {
    const d = $("#replay-delay");
    return d ? Number(d.value) : 400;
  };

  function score(text, shown) {
    const box = text.parentElement && text.parentElement.querySelector(".lane-score");
    if (!box || !shown.length) return;
    let n = 0, ms = 0;
    for (const c of shown) { n += Number(c.dataset.n || 0); ms += Number(c.dataset.ms || 0); }
    box.querySelector(".score-tpf").textContent = (n / shown.length).toFixed(2);
    // a slow-motion race's forwards ran after pauses, cold: the page quotes no tokens/s for them (render.py)
    const slowed = Number(text.dataset.slowed || 1) > 1;
    box.querySelector(".score-tps").textContent = ms > 0 && !slowed ? (n / (ms / 1000)).toFixed(0) : "–";
  }

  function apply() {
    const live = state.pos === null;
    for (const t of texts()) {
      const chunks = chunksOf(t);
      const k = live ? chunks.length : Math.min(state.pos, chunks.length);
      for (const c of Array.from(t.children)) {
        if (c.classList.contains("chunk")) {
          c.style.display = chunks.indexOf(c) < k ? "" : "none";
        } else if (c.classList.contains("tau-mark")) {
          // a τ mark belongs to the chunk after it
          let next = c.nextElementSibling;
          while (next && !next.classList.contains("chunk")) next = next.nextElementSibling;
          c.style.display = !next || chunks.indexOf(next) < k ? "" : "none";
        } else if (c.classList.contains("cursor") || c.classList.contains("pending-drafts")) {
          c.style.display = live ? "" : "none";
        }
      }
      t.dataset.shown = String(k);
      score(t, chunks.slice(0, k));
    }
    const ready = finished();
    for (const id of ["replay-start", "replay-back", "replay-play", "replay-step", "replay-end"]) {
      const b = document.getElementById(id);
      if (b) b.disabled = !ready;
    }
    const play = $("#replay-play");
    if (play) play.textContent = state.playing ? "⏸ pause" : "▶ play";
    const where = $("#replay-where");
    if (where) {
      where.textContent = !ready ? "after a race"
        : live ? `all ${total()} forwards`
        : `forward ${state.pos} of ${total()}`;
      where.dataset.pos = live ? "" : String(state.pos);
    }
  }

  function stop() {
    state.playing = false;
    if (state.timer) clearTimeout(state.timer);
    state.timer = null;
  }
  function tick() {
    if (!state.playing) return;
    if (state.pos >= total()) { stop(); apply(); return; }
    state.pos += 1;
    apply();
    state.timer = setTimeout(tick, delay());   // the delay is read every pass: moving it acts at once
  }
  const actions = {
    "replay-start": () => { stop(); state.pos = 0; },
    "replay-back": () => { stop(); state.pos = Math.max(0, (state.pos === null ? total() : state.pos) - 1); },
    "replay-step": () => { stop(); state.pos = Math.min(total(), (state.pos === null ? 0 : state.pos) + 1); },
    "replay-end": () => { stop(); state.pos = null; },
    "replay-play": () => {
      if (state.playing) { stop(); return; }
      if (state.pos === null || state.pos >= total()) state.pos = 0;
      state.playing = true;
      state.timer = setTimeout(tick, delay());
    },
  };

  document.addEventListener("click", (e) => {
    const b = e.target.closest && e.target.closest("button[id^='replay-']");
    if (!b || !actions[b.id] || !finished()) return;
    actions[b.id]();
    apply();
  });
  document.addEventListener("input", (e) => {
    if (e.target && e.target.id === "replay-delay") {
      const out = $("#replay-delay-value");
      if (out) out.textContent = `${e.target.value} ms/forward`;
      if (state.playing) {   // a new delay takes effect from the next pass, not after the old wait
        clearTimeout(state.timer);
        state.timer = setTimeout(tick, delay());
      }
    }
  });

  let queued = false;
  const observer = new MutationObserver(() => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      if (!finished() && state.pos !== null) { stop(); state.pos = null; }   // a new race: live view
      observer.disconnect();
      apply();
      observer.observe(document.body, { childList: true, subtree: true });
    });
  });
  function start() {
    observer.observe(document.body, { childList: true, subtree: true });
    apply();
    if (new URLSearchParams(location.search).get("present") === "1") document.body.classList.add("present");
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
  window.marsReplay = { state, apply, actions };
})();
