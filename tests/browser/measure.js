// Test-only: measure what the browser drew (after layout) and append it as JSON to the page,
// so that `chromium --headless --dump-dom` returns it. Pages kvlc writes carry no script.
(function () {
  function box(e) {
    if (!e) return null;
    const r = e.getBoundingClientRect();
    return {x: r.x, y: r.y, w: r.width, h: r.height};
  }
  function all(sel, f, root) { return Array.from((root || document).querySelectorAll(sel)).map(f); }
  const out = {};
  out.storages = all('svg.map g.storage', g => ({
    map: g.closest('svg').dataset.mem, name: g.dataset.storage, count: +g.dataset.count,
    bar: box(g.querySelector('rect.bar')), label: all('text', t => t.textContent, g).join(' ')}));
  out.regions = all('svg.map g.region', g => ({
    map: g.closest('svg').dataset.mem, name: g.dataset.region, label: g.dataset.label,
    box: box(g.querySelector('rect.extent'))}));
  out.maps = all('svg.map', s => ({mem: s.dataset.mem, scale: +s.dataset.scaleBytes, box: box(s)}));
  out.blocks = all('svg.block', s => ({
    regions: s.dataset.regions, bytes: +s.dataset.blockBytes, bar: box(s.querySelector('rect.bar')),
    fields: all('g.field', g => ({
      name: g.dataset.field, order: g.dataset.order, replicas: +g.dataset.replicas,
      box: box(g.querySelector('rect.extent')), slices: all('rect.slice', box, g),
      notes: all('text.note', t => ({text: t.textContent, box: box(t)}), g)}), s)}));
  out.bands = all('polygon.band', p => ({c: +p.dataset.consumer, p: +p.dataset.producer,
                                          h0: +p.dataset.h0, h1: +p.dataset.h1, box: box(p)}));
  out.ranks = all('g.rank', g => ({side: g.dataset.side, rank: +g.dataset.rank, h0: +g.dataset.h0,
                                    h1: +g.dataset.h1, box: box(g.querySelector('rect'))}));
  out.peers = all('g.peer', g => ({peer: +g.dataset.peer, runs: +g.dataset.runs, box: box(g.querySelector('rect'))}));
  out.local = all('rect.local', box);
  out.lruns = all('rect.lrun', r => ({peer: +r.closest('g').dataset.peer, field: r.closest('g').dataset.field, box: box(r)}));
  out.rruns = all('rect.rrun', r => ({peer: +r.closest('g').dataset.peer, field: r.closest('g').dataset.field, box: box(r)}));
  out.texts = all('svg text', t => t.textContent);
  out.viewport = {w: window.innerWidth, h: window.innerHeight};
  const pre = document.createElement('pre');
  pre.id = 'kvlc-geometry';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
