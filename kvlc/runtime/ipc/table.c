/*
 * The same-host copy's row table in one pass: a part's descriptor rows, the peer's side moved into its
 * mapped window, cut into pieces of at most `chunk` bytes, written as the kernel reads them.
 *
 * A plain C library (no Python API), loaded through ctypes by kvlc/runtime/ipc/native.py, so one build
 * loads on any CPython. The numpy code it mirrors is the reference (kvlc.runtime.ipc.route._Windows.translate
 * and kvlc.runtime.ipc.copy.row_table with KVLC_NATIVE=0); tests/runtime/test_ipc_table.py proves them
 * identical with hypothesis. Rows are C-contiguous int64 (addr, len, dev) triples.
 */
#include <stdint.h>

#include <string.h>

int kvlc_ipc_abi_version(void) { return 4; }

/* A driver's asynchronous copy (cuMemcpyAsync's signature: destination, source, bytes, stream; 0 when queued). */
typedef int (*kvlc_copy_fn)(uint64_t dst, uint64_t src, uint64_t n, void *stream);

/* Queue one copy per row of a launch table (sources, destinations, lengths: `rows` of each) through `fn`, in
 * order, on `stream`: -1 when every row was queued, else the index of the row `fn` refused (its code in *code;
 * the rows before it are queued). Called with the GIL held and the device's context current (the caller's). */
int64_t kvlc_ipc_queue(void *fn, const uint64_t *table, int64_t rows, void *stream, int64_t *code)
{
    kvlc_copy_fn copy = (kvlc_copy_fn)fn;
    const uint64_t *src = table, *dst = table + rows, *len = table + 2 * rows;
    for (int64_t i = 0; i < rows; i++) {
        int got = copy(dst[i], src[i], len[i], stream);
        if (got) {
            *code = got;
            return i;
        }
    }
    return -1;
}

/* The CUDA driver's calls a copy's start makes, by address (libcuda's; the tests' stand-ins): their signatures. */
struct kvlc_driver {
    int (*ctx_get)(void **ctx);
    int (*ctx_push)(void *ctx);
    int (*ctx_pop)(void **ctx);
    int (*event_create)(void **event, unsigned flags);
    int (*event_record)(void *event, void *stream);
    int (*event_destroy)(void *event);
    int (*stream_wait)(void *stream, void *event, unsigned flags);
    int (*stream_sync)(void *stream);
    int (*launch)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned shared, void *stream, void **params, void **extra);
};

/* One copy's start: the engine's stream (`caller`) and the event recorded on it (`waited`), the copy's stream;
 * `nbytes` of `words` written at `ring` first (the row table the kernel reads in place; 0: none); the kernel
 * (`function` on `grid`, `threads` a block, `shared` bytes) with its parameter block `params`. */
struct kvlc_start {
    void *ctx, *caller, *waited, *stream;
    void *ring;
    const void *words;
    int64_t nbytes;
    void *function;
    uint32_t grid[3];
    uint32_t threads, shared;
    void **params;
};

/* What kvlc_ipc_start did last: its steps, in order (a failed step's number is returned). */
enum { KVLC_START_CONTEXT, KVLC_START_RECORD_CALLER, KVLC_START_WAIT, KVLC_START_EVENT, KVLC_START_LAUNCH,
       KVLC_START_RECORD_AFTER };

#define KVLC_EVENT_DISABLE_TIMING 0x2

/* A copy's start in one call, with the GIL held (the caller's: no other Python thread runs between the driver's
 * calls): the device's context made current where it is not (and given back after), `words` into the ring, an
 * event recorded on the engine's stream and the copy's stream made to wait for it (the copy reads what the engine
 * queued before), a new event created, the kernel launched, that event recorded after it. -1 with *event set when
 * every step succeeded; else the step that failed (enum above), the driver's code in *code and no event: a step
 * before the launch launched nothing; where recording after the launch fails, the copy's stream is waited for (no
 * byte lands after the error is reported) and the new event destroyed. */
int64_t kvlc_ipc_start(const struct kvlc_driver *d, const struct kvlc_start *s, void **event, int64_t *code)
{
    void *current = 0, *made = 0;
    int pushed = 0, got;
    int64_t step = -1;
    *event = 0;
    if ((got = d->ctx_get(&current)) != 0) {
        step = KVLC_START_CONTEXT;
        goto out;
    }
    if (current != s->ctx) {
        if ((got = d->ctx_push(s->ctx)) != 0) {
            step = KVLC_START_CONTEXT;
            goto out;
        }
        pushed = 1;
    }
    if (s->nbytes > 0)
        memcpy(s->ring, s->words, (size_t)s->nbytes);
    if ((got = d->event_record(s->waited, s->caller)) != 0) {
        step = KVLC_START_RECORD_CALLER;
        goto out;
    }
    if ((got = d->stream_wait(s->stream, s->waited, 0)) != 0) {
        step = KVLC_START_WAIT;
        goto out;
    }
    if ((got = d->event_create(&made, KVLC_EVENT_DISABLE_TIMING)) != 0) {
        step = KVLC_START_EVENT;
        goto out;
    }
    if ((got = d->launch(s->function, s->grid[0], s->grid[1], s->grid[2], s->threads, 1, 1, s->shared, s->stream,
                         s->params, 0)) != 0) {
        d->event_destroy(made);
        step = KVLC_START_LAUNCH;
        goto out;
    }
    if ((got = d->event_record(made, s->stream)) != 0) {
        d->stream_sync(s->stream);
        d->event_destroy(made);
        step = KVLC_START_RECORD_AFTER;
        goto out;
    }
    *event = made;
out:
    if (pushed) {
        void *popped = 0;
        d->ctx_pop(&popped);
    }
    *code = got;
    return step;
}

/* The window holding [addr, addr + len): its index, or -1. Windows sorted by start; `hint` is tried first
 * (consecutive rows mostly lie in one window); `ok` (NULL: every window) says which may hold it. */
static int64_t window_of(uint64_t addr, uint64_t len, const uint64_t *starts, const uint64_t *stops,
                         const int64_t *ok, int64_t nwin, int64_t hint)
{
    uint64_t end = addr + len;
    if (end < addr)
        return -1;
    int64_t k = hint;
    if (k < 0 || k >= nwin || addr < starts[k] || (k + 1 < nwin && addr >= starts[k + 1])) {
        int64_t lo = 0, hi = nwin; /* the last window whose start is <= addr */
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (starts[mid] <= addr)
                lo = mid + 1;
            else
                hi = mid;
        }
        k = lo - 1;
    }
    if (k < 0 || end > stops[k] || (ok && !ok[k]))
        return -1;
    return k;
}

/* -1 when every row [addr[i], addr[i] + lens[i]) has bytes and lies inside one of the `nwin` regions
 * [starts, stops) (sorted by start, not overlapping), else the index of the first that does not: the
 * same-host DRAM copy's check of both sides before its first memmove (the reference:
 * kvlc.runtime.staging.copy.Regions.locate). */
int64_t kvlc_ipc_inside(const uint64_t *addr, const uint64_t *lens, int64_t n, const uint64_t *starts,
                        const uint64_t *stops, int64_t nwin)
{
    int64_t k = -1;
    for (int64_t i = 0; i < n; i++) {
        if (!lens[i])
            return i;
        k = window_of(addr[i], lens[i], starts, stops, 0, nwin, k);
        if (k < 0)
            return i;
    }
    return -1;
}

/* A part's launch table at `out` (3 * cap int64: sources, destinations, lengths, `cap` of each), in one
 * pass: every peer row checked against the windows (`ok[k]`: window k holds this part's memory type) and
 * moved by its window's shift (modulo 2**64); `write` != 0: the local rows are the sources (a WRITE), else
 * the peer's. Rows longer than `chunk` are cut into pieces of at most `chunk` bytes, in order (a row of 0
 * bytes then gives none), as the reference's split; `cap` (at least `n`) must hold them.
 *
 * Returns -1 when the table is written (`info[0]`: its rows, `info[1]`: the OR of its words' low four
 * bits); the index of the first peer row outside every usable window (nothing written is to be used);
 * or -2 when the table needs `info[0]` > `cap` rows (cut rows): call again with that room (the rows
 * are checked in full before -2 is returned). */
int64_t kvlc_ipc_table(const int64_t *local, const int64_t *remote, int64_t n, int write, const uint64_t *starts,
                       const uint64_t *stops, const int64_t *shifts, const int64_t *ok, int64_t nwin, int64_t chunk,
                       int64_t cap, int64_t *out, int64_t *info)
{
    uint64_t *src = (uint64_t *)out, *dst = src + cap, *lens = dst + cap;
    uint64_t c = (uint64_t)chunk, bits = 0, lo = 1, hi = 0, shift = 0; /* the current window: [lo, hi) */
    int64_t k = -1, w = 0, cut = 0;
    if (cap < n) { /* the room every uncut row needs */
        info[0] = n;
        return -2;
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t ra = (uint64_t)remote[3 * i], end = ra + (uint64_t)remote[3 * i + 1];
        if (!(ra >= lo && ra < hi && end <= hi && end >= ra)) { /* not inside the window of the row before */
            k = window_of(ra, (uint64_t)remote[3 * i + 1], starts, stops, ok, nwin, k);
            if (k < 0)
                return i;
            lo = starts[k], hi = stops[k], shift = (uint64_t)shifts[k];
            if (k + 1 < nwin && starts[k + 1] < hi)
                hi = starts[k + 1]; /* (never for real windows: they do not overlap) */
            if (ra >= hi) /* an empty row at the window's end: place it, but keep the next rows searching */
                lo = 1, hi = 0;
        }
        uint64_t mine = (uint64_t)local[3 * i], len = (uint64_t)local[3 * i + 1];
        uint64_t theirs = ra + shift;
        uint64_t s = write ? mine : theirs, d = write ? theirs : mine;
        if (len <= c && !cut) {
            if (w < cap)
                src[w] = s, dst[w] = d, lens[w] = len;
            bits |= s | d | len;
            w++;
            continue;
        }
        if (!cut) { /* the first row to cut: the rows before it (all written: w <= i < n <= cap) each stay
                     * one piece, but empty ones go */
            cut = 1;
            int64_t kept = 0;
            bits = 0;
            for (int64_t j = 0; j < w; j++)
                if (lens[j]) {
                    src[kept] = src[j], dst[kept] = dst[j], lens[kept] = lens[j], kept++;
                    bits |= src[j] | dst[j] | lens[j];
                }
            w = kept;
        }
        for (uint64_t off = 0; off < len; off += c) {
            uint64_t m = len - off < c ? len - off : c;
            if (w < cap)
                src[w] = s + off, dst[w] = d + off, lens[w] = m;
            bits |= (s + off) | (d + off) | m;
            w++;
            if (off > UINT64_MAX - c) /* (a length near 2**64: the next step would wrap) */
                break;
        }
    }
    info[0] = w;
    info[1] = (int64_t)(bits & 15);
    return w > cap ? -2 : -1;
}
