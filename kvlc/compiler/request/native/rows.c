/*
 * kvlc's per-request hot path in C: block-id checks and descriptor rows, coalesced as they are written.
 *
 * A plain C library (no Python API), loaded through ctypes by kvlc/compiler/request/native/__init__.py,
 * so one build loads on any CPython version. The Python code it mirrors is the reference
 * (kvlc.compiler.request.check and .instantiate with KVLC_NATIVE=0); tests/test_native.py proves them
 * identical with hypothesis. Arrays are C-contiguous int64; a row is (addr, len, dev).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Table layouts (int64), built once per binding by the Python side:
 *   geometry at g: E, then base[2][E], stride[2][E], dev[2][E]  (side 0 local, 1 remote)
 *   runs at r:     M, then local_block[M], remote_block[M], local_offset[M], remote_offset[M], length[M]
 * A piece (PIECE int64s, built per request): count tiles from tile `first` of one block, with one run
 * template: geometry, runs, first, count, local sub, remote sub, local shift, remote shift,
 * local ids offset, local ids count, remote ids offset, remote ids count, part, block.
 * The consecutive pieces of one block (same `block`) are its token order: for every entry, every piece's
 * rows follow each other, as the reference lays out a block's (entries, runs) rows. */
enum { PIECE = 14 };

int kvlc_abi_version(void) { return 4; }

/* Of a slot's n tiles (local ids at ids[at..at+n), remote ids right after them), those k in [1, n) whose local or
 * remote id does not follow the tile before it (id + 1, modulo 2**64 as numpy's int64 wraps): the breaks of its
 * merged rows (kvlc.compiler.request.blocks.BlockCopy.runs). */
int64_t kvlc_breaks(const int64_t *ids, int64_t at, int64_t n)
{
    const uint64_t *l = (const uint64_t *)ids + at, *r = l + n;
    int64_t out = 0;
    for (int64_t k = 1; k < n; k++)
        out += (l[k] != l[k - 1] + 1u) | (r[k] != r[k - 1] + 1u);
    return out;
}

/* 1: every id in [0, capacity) and, if distinct != 0, no id twice; 0 otherwise; -1: out of memory. */
int kvlc_ids_ok(const int64_t *ids, int64_t n, int64_t capacity, int distinct)
{
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= capacity)
            return 0;
    if (!distinct || n < 2)
        return 1;
    uint64_t words = ((uint64_t)capacity + 63) / 64;
    uint64_t *seen = calloc(words ? words : 1, sizeof(uint64_t));
    if (!seen)
        return -1;
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        uint64_t v = (uint64_t)ids[i], bit = 1ull << (v & 63);
        if (seen[v >> 6] & bit)
            ok = 0;
        seen[v >> 6] |= bit;
    }
    free(seen);
    return ok;
}

/* A part's rows as they are written: both sides, `w` rows so far from `local` / `remote`. */
struct cursor {
    int64_t *local, *remote, w;
};

/* Append one row pair, merged into the last one where it continues it on both sides (address + length,
 * same device): the rows come out coalesced in order, as the reference's coalesce leaves them. */
static inline void put(struct cursor *c, int64_t la, int64_t ra, int64_t n, int64_t ld, int64_t rd)
{
    if (c->w) {
        int64_t *l = c->local + 3 * (c->w - 1), *r = c->remote + 3 * (c->w - 1);
        if ((uint64_t)l[0] + (uint64_t)l[1] == (uint64_t)la && (uint64_t)r[0] + (uint64_t)r[1] == (uint64_t)ra
            && l[2] == ld && r[2] == rd) {
            l[1] += n;
            r[1] += n;
            return;
        }
    }
    int64_t *l = c->local + 3 * c->w, *r = c->remote + 3 * c->w;
    l[0] = la, l[1] = n, l[2] = ld;
    r[0] = ra, r[1] = n, r[2] = rd;
    c->w++;
}

/* 1 when every id the piece reads lies inside its group's ids (a caller bug otherwise). */
static int piece_in_bounds(const int64_t *pc, const int64_t *r)
{
    int64_t M = r[0];
    for (int s = 0; s < 2; s++) {
        const int64_t *blk = r + 1 + s * M;
        int64_t sub = pc[4 + s], shift = pc[6 + s], n = pc[9 + 2 * s];
        for (int64_t m = 0; m < M; m++) {
            int64_t lo = pc[2] * sub + blk[m] - shift, hi = (pc[2] + pc[3] - 1) * sub + blk[m] - shift;
            if (lo < 0 || hi >= n || lo > hi)
                return 0;
        }
    }
    return 1;
}

/* Whether a piece can be written by segments: one run per tile, one kernel block per tile on both sides. */
static int segmentable(const int64_t *pc, const int64_t *r) { return r[0] == 1 && pc[4] == 1 && pc[5] == 1; }

/* For a segmentable piece: seg[t] = how many tiles from tile t on read consecutive ids on both sides
 * (0 inside such a stretch). Those tiles' rows continue each other wherever an entry's block stride is
 * the run's length on both sides (whole blocks): one row is written for them. */
static void segments(const int64_t *pc, const int64_t *r, const int64_t *ids, int64_t *seg)
{
    const int64_t *kl = ids + pc[8] + pc[2] + r[1] - pc[6], *kr = ids + pc[10] + pc[2] + r[2] - pc[7];
    int64_t count = pc[3];
    for (int64_t t = 0; t < count;) {
        int64_t k = 1;
        while (t + k < count && kl[t + k] == kl[t] + k && kr[t + k] == kr[t] + k)
            k++;
        seg[t] = k;
        for (int64_t j = 1; j < k; j++)
            seg[t + j] = 0;
        t += k;
    }
}

/* The rows of entry e of one piece (seg: its segments, or NULL). */
static void piece_rows(struct cursor *c, const int64_t *pc, const int64_t *g, const int64_t *r, const int64_t *ids,
                       int64_t e, const int64_t *seg)
{
    int64_t E = g[0], M = r[0];
    const int64_t *lb = r + 1, *rb = r + 1 + M, *lo = r + 1 + 2 * M, *ro = r + 1 + 3 * M, *len = r + 1 + 4 * M;
    int64_t lbase = g[1 + e], rbase = g[1 + E + e], lst = g[1 + 2 * E + e], rst = g[1 + 3 * E + e];
    int64_t ldev = g[1 + 4 * E + e], rdev = g[1 + 5 * E + e];
    const int64_t *kl = ids + pc[8], *kr = ids + pc[10];
    if (seg && lst == len[0] && rst == len[0]) {
        const int64_t *tl = kl + pc[2] + lb[0] - pc[6], *tr = kr + pc[2] + rb[0] - pc[7];
        for (int64_t t = 0; t < pc[3]; t += seg[t])
            put(c, lbase + tl[t] * lst + lo[0], rbase + tr[t] * rst + ro[0], len[0] * seg[t], ldev, rdev);
        return;
    }
    for (int64_t t = pc[2]; t < pc[2] + pc[3]; t++) {
        const int64_t *tl = kl + t * pc[4] - pc[6], *tr = kr + t * pc[5] - pc[7];
        for (int64_t m = 0; m < M; m++)
            put(c, lbase + tl[lb[m]] * lst + lo[m], rbase + tr[rb[m]] * rst + ro[m], len[m], ldev, rdev);
    }
}

/* One request in one call. out: (2, N, 3) int64, side 1 at out + side. parts: nparts (start, rows)
 * pairs; part p's rows are written from row `start`, and the rows left after coalescing replace
 * `rows`. Returns 0, or 1 + the index of a piece that reads outside its group's ids. */
int64_t kvlc_emit(const int64_t *table, const int64_t *pieces, int64_t npieces, const int64_t *ids, int64_t *out,
                  int64_t side, int64_t *parts, int64_t nparts)
{
    for (int64_t p = 0; p < npieces; p++)
        if (!piece_in_bounds(pieces + p * PIECE, table + pieces[p * PIECE + 1]))
            return 1 + p;
    for (int64_t k = 0; k < nparts; k++)
        parts[2 * k + 1] = 0;
    for (int64_t p = 0; p < npieces;) {
        const int64_t *first = pieces + p * PIECE;
        int64_t q = p + 1;
        while (q < npieces && pieces[q * PIECE + 13] == first[13])
            q++;
        int64_t part = first[12];
        struct cursor c = {out + parts[2 * part] * 3, out + side + parts[2 * part] * 3, parts[2 * part + 1]};
        const int64_t *g = table + first[0];
        int64_t tiles = 0;
        for (int64_t i = p; i < q; i++)
            tiles += segmentable(pieces + i * PIECE, table + pieces[i * PIECE + 1]) ? pieces[i * PIECE + 3] : 0;
        int64_t *seg = tiles && g[0] > 1 ? malloc(tiles * sizeof(int64_t)) : NULL;
        for (int64_t i = p, at = 0; seg && i < q; i++)
            if (segmentable(pieces + i * PIECE, table + pieces[i * PIECE + 1])) {
                segments(pieces + i * PIECE, table + pieces[i * PIECE + 1], ids, seg + at);
                at += pieces[i * PIECE + 3];
            }
        for (int64_t e = 0; e < g[0]; e++)
            for (int64_t i = p, at = 0; i < q; i++) {
                const int64_t *pc = pieces + i * PIECE, *r = table + pc[1];
                int s = seg && segmentable(pc, r);
                piece_rows(&c, pc, g, r, ids, e, s ? seg + at : NULL);
                at += s ? pc[3] : 0;
            }
        free(seg);
        parts[2 * part + 1] = c.w;
        p = q;
    }
    return 0;
}
