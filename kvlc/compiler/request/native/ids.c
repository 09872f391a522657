/* A request's block ids, read from the engine's Python list in one pass: converted, bounded, and (on the
 * receiving side) checked for repeats, without a numpy array or a Python loop in between.
 *
 * Unlike rows.c this reads Python objects, so it uses Python's limited (stable) C API: one build loads on
 * every CPython from 3.11 on. kvlc loads it with ctypes.PyDLL, which keeps the GIL held during the call; the
 * call runs no Python code (an exact int converts without calling back), so the list cannot change meanwhile.
 *
 * The Python reference is kvlc/compiler/request/check.py (block_ids, _check_ids): wherever this returns
 * anything but 0 the reference runs and words the refusal, so both refuse the same ids with the same words.
 */
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

int kvlc_ids_abi_version(void) { return 1; }

/* The bitmap of ids seen, kept between calls (all bits clear between calls) and grown as needed; the GIL,
 * held throughout every call, serialises its users. */
static uint64_t *seen;
static uint64_t seen_words;
#define BITMAP_WORDS_MAX (1ull << 20)  /* 8 MiB: regions of up to 2**26 blocks */

/* 1: an id repeats; 0: none does; 2: not decided here (the reference looks); -1: no memory. */
static int repeats(const int64_t *ids, int64_t n, int64_t capacity)
{
    if (n <= 32) {  /* a few ids: compare them pairwise, no bitmap */
        for (int64_t i = 1; i < n; i++)
            for (int64_t j = 0; j < i; j++)
                if (ids[i] == ids[j])
                    return 1;
        return 0;
    }
    uint64_t words = ((uint64_t)capacity + 63) / 64;
    if (words > BITMAP_WORDS_MAX)
        return 2;  /* a region of more blocks than the bitmap keeps: the reference sorts them */
    if (words > seen_words) {
        uint64_t *grown = calloc(words, sizeof(uint64_t));
        if (!grown)
            return -1;
        free(seen);
        seen = grown;
        seen_words = words;
    }
    int64_t i = 0;
    int found = 0;
    for (; i < n; i++) {
        uint64_t v = (uint64_t)ids[i], bit = 1ull << (v & 63);
        if (seen[v >> 6] & bit) {
            found = 1;
            break;
        }
        seen[v >> 6] |= bit;
    }
    for (int64_t k = 0; k < i; k++)  /* leave every bit clear again (only the words touched) */
        seen[(uint64_t)ids[k] >> 6] = 0;
    return found;
}

/* The `n` items of list (kind 0) or tuple (kind 1) `seq` into out[0..n) when every one is an exact int that
 * fits int64; then out[lo..hi) checked: each id in [0, capacity) and, if `distinct`, none twice.
 * 0: converted and checked; 1: an item is not an exact int, does not fit, or the sequence is shorter than n
 * (the reference words it); 2: converted, but an id in [lo, hi) is out of range or repeats (the reference
 * words it); -1: no memory for the bitmap. */
int kvlc_seq_ids(PyObject *seq, int kind, int64_t n, int64_t *out, int64_t lo, int64_t hi, int64_t capacity,
                 int distinct)
{
    for (int64_t i = 0; i < n; i++) {
        PyObject *item = kind ? PyTuple_GetItem(seq, (Py_ssize_t)i) : PyList_GetItem(seq, (Py_ssize_t)i);
        if (item == NULL) {
            PyErr_Clear();
            return 1;
        }
        if (!PyLong_CheckExact(item))  /* bool, numpy integers, floats ...: the reference decides */
            return 1;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 1;
        }
        out[i] = (int64_t)v;
    }
    if (lo < 0 || hi > n || lo > hi)
        return 2;
    for (int64_t i = lo; i < hi; i++)
        if (out[i] < 0 || out[i] >= capacity)
            return 2;
    if (distinct && hi - lo > 1) {
        int r = repeats(out + lo, hi - lo, capacity);
        if (r)
            return r < 0 ? -1 : 2;  /* a repeat, or too many blocks for the bitmap: the reference decides */
    }
    return 0;
}
