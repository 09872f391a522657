/*
 * The same-host doorbell: a ring in a shared-memory file that one peer process writes its notifications
 * into and this process reads, instead of NIXL's notifications (kvlc/runtime/ipc/bell.py says when).
 *
 * A plain C library (no Python API), loaded through ctypes. One writer and one reader per ring, each in its
 * own process; positions are published with release stores and read with acquire loads, so a record's
 * bytes are seen before the position that covers them, on any CPU.
 *
 * Layout (`size` bytes): the write position at byte 0 and the read position at byte 64 (uint64, bytes
 * written / taken since the ring was made; each on its own cache line), records from byte 128 on, in a
 * data area of `cap` = size - 128 bytes (a multiple of 8). A record at data offset `at` = position % cap:
 * its length n (uint32), 4 bytes of 0, then its n bytes, padded to 8. A record never wraps: where it does
 * not fit before the end, a WRAP length marks the rest as skipped and the record starts at offset 0.
 *
 * Neither side trusts the other's half: the writer refuses to write where the read position it sees is
 * impossible, the reader drops everything written where a position or a record is (both stay inside the
 * file whatever it holds).
 */
#include <stdint.h>
#include <string.h>

enum { WPOS = 0, RPOS = 64, HEAD = 128 };
#define WRAP 0xFFFFFFFFu

int kvlc_bell_abi_version(void) { return 1; }

static inline uint64_t pad8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

/* The most bytes one record may hold in a ring of `size` bytes (so that it always fits once the ring is
 * empty, wherever the write position stands), or -1 where `size` is not a ring's. */
int64_t kvlc_bell_most(int64_t size)
{
    if (size <= HEAD + 64 || (size - HEAD) % 8)
        return -1;
    return (size - HEAD) / 2 - 8;
}

/* Write one record of `n` bytes: 1 when written, 0 when the ring has no room for it now (or the reader's
 * position is impossible: the caller sends it another way), -1 when it can never fit (see kvlc_bell_most). */
int64_t kvlc_bell_put(uint8_t *base, int64_t size, const uint8_t *msg, int64_t n)
{
    int64_t most = kvlc_bell_most(size);
    if (most < 0 || n < 0 || n > most)
        return -1;
    uint64_t cap = (uint64_t)(size - HEAD);
    uint64_t *wp = (uint64_t *)(base + WPOS), *rp = (uint64_t *)(base + RPOS);
    uint64_t w = __atomic_load_n(wp, __ATOMIC_RELAXED); /* only this writer stores it */
    uint64_t r = __atomic_load_n(rp, __ATOMIC_ACQUIRE);
    if (w % 8 || w - r > cap)
        return 0;
    uint64_t need = 8 + pad8((uint64_t)n), at = w % cap, tail = cap - at;
    uint64_t skip = need > tail ? tail : 0;
    if (w - r + skip + need > cap)
        return 0;
    uint8_t *data = base + HEAD;
    if (skip) {
        uint32_t mark = WRAP;
        memcpy(data + at, &mark, 4);
        at = 0;
    }
    uint32_t len = (uint32_t)n, zero = 0;
    memcpy(data + at, &len, 4);
    memcpy(data + at + 4, &zero, 4);
    memcpy(data + at + 8, msg, (size_t)n);
    __atomic_store_n(wp, w + skip + need, __ATOMIC_RELEASE);
    return 1;
}

/* Take the records written since the last call, oldest first: their bytes one after another into `out`
 * (`room` bytes), their lengths into `lens` (at most `max`). Returns how many were taken (what did not fit
 * stays for the next call). `*bad` is set to 1 where a position or a record was impossible: the records
 * after the last good one are dropped (the ring is usable again at once), else to 0. */
int64_t kvlc_bell_take(uint8_t *base, int64_t size, uint8_t *out, int64_t room, int64_t *lens, int64_t max,
                       int64_t *bad)
{
    *bad = 0;
    if (kvlc_bell_most(size) < 0) {
        *bad = 1;
        return 0;
    }
    uint64_t cap = (uint64_t)(size - HEAD);
    uint64_t *wp = (uint64_t *)(base + WPOS), *rp = (uint64_t *)(base + RPOS);
    uint64_t w = __atomic_load_n(wp, __ATOMIC_ACQUIRE);
    uint64_t r = __atomic_load_n(rp, __ATOMIC_RELAXED); /* only this reader stores it */
    const uint8_t *data = base + HEAD;
    int64_t k = 0;
    uint64_t used = 0;
    if (w == r)
        return 0;
    if (w % 8 || r % 8 || w - r > cap)
        goto corrupt;
    while (r != w && k < max) {
        uint64_t at = r % cap, tail = cap - at;
        uint32_t len;
        memcpy(&len, data + at, 4);
        if (len == WRAP) {
            if (tail > w - r)
                goto corrupt;
            r += tail;
            continue;
        }
        uint64_t need = 8 + pad8(len);
        if (need > tail || need > w - r)
            goto corrupt;
        if (used + len > (uint64_t)room)
            break;
        memcpy(out + used, data + at + 8, len);
        lens[k++] = len;
        used += len;
        r += need;
    }
    __atomic_store_n(rp, r, __ATOMIC_RELEASE);
    return k;
corrupt:
    *bad = 1;
    __atomic_store_n(rp, w, __ATOMIC_RELEASE);
    return k;
}
