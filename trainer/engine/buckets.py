"""Ragged decode attention's plan: a decode step's rows grouped by cached length into a few
buckets, each attending over its own longest row (trainer/engine/decoder.py runs the plan).

The rows are put in geometric length classes (two per octave); the plan is the cheapest under
the cost model below: the base bucket covers the classes up to some class j as a plain slice
over all rows, the classes above j go in contiguous gathered groups, at most MAX_BUCKETS in
all, or one bucket (the padded batch) when splitting does not pay. Pure logic: no tensors.
Tests: tests/test_engine_ragged.py (the plan is the cheapest by exhaustive search).
"""
from __future__ import annotations

# Cost model of a decode step's attention, in "row-positions" (one row attending over one cached
# position) per layer. The base bucket reads the cache as a slice over all rows: B x T. A
# gathered bucket copies its rows' keys and values out of the cache first (memory traffic: the
# cache is larger than the CPU's caches) and costs GATHER_FACTOR x rows x T, plus a fixed
# BUCKET_OVERHEAD (index, mask, copies and an attention call per layer). CPU (2 cores, 1 thread,
# built-in model, 512-position cache), in a decode step: a sliced row-position ~0.047 us, a
# gathered one ~0.16 us (3.4x), a bucket's fixed work ~60-100 us (~2000 row-positions); the
# default 4096 leaves a margin for noisy machines. On CUDA the fixed cost is kernel launches
# while a row-position costs a fraction of a ns: split only very ragged batches.
BUCKET_OVERHEAD = {"cpu": 4096, "cuda": 131072}
GATHER_FACTOR = 3.4
MAX_BUCKETS = 6


def _length_class(T: int) -> int:
    """Geometric length classes, two per octave (..., 24, 32, 48, 64, 96, ...; <= 16 is one)."""
    e = max((T - 1).bit_length(), 4)   # T <= 2**e
    return 2 * e if e == 4 or T > 3 << (e - 2) else 2 * e - 1


_CLASS_OF_LEN: list[int] = []  # _length_class(n + 1) for cached length n, grown on demand


def _classes(up_to: int) -> list[int]:
    global _CLASS_OF_LEN
    table = _CLASS_OF_LEN
    if len(table) <= up_to:  # a new list, swapped in whole: safe for engines in other threads
        table = [_length_class(n + 1) for n in range(max(2 * up_to + 1, 1024))]
        _CLASS_OF_LEN = table
    return table


def plan_buckets(lengths: list[int], overhead: float,
                 gather: float = GATHER_FACTOR, max_buckets: int = MAX_BUCKETS) -> list[tuple]:
    """Group decode rows by cached length. Row r attends over lengths[r] + 1 positions.
    Returns [(rows, T, min_len)]: first the base bucket (rows None: all rows, read as a slice,
    over T positions), then gathered buckets of longer rows (row indices ascending), T each
    bucket's longest row + 1. The rows are put in geometric length classes; the plan is the
    cheapest under the cost model above (BUCKET_OVERHEAD): the base covers the classes up to
    some class j (the longer rows are computed there too and overwritten by their own bucket),
    the classes above j go in contiguous groups, at most `max_buckets` buckets in all. One
    bucket (the padded batch) when splitting does not pay. overhead = 0 (tests): gathering
    costs nothing either, so the rows are split wherever that saves a position."""
    if overhead <= 0:
        gather = 1.0
    B = len(lengths)
    lo, hi = min(lengths), max(lengths)
    if B == 1 or lo == hi or B * hi - sum(lengths) <= overhead:
        return [(None, hi + 1, lo)]
    classes: dict[int, list] = {}
    class_of = _classes(hi)
    for r, n in enumerate(lengths):
        k = class_of[n]
        c = classes.get(k)
        if c is None:
            classes[k] = [[r], n, n]   # rows, max len, min len
        else:
            c[0].append(r)
            if n > c[1]:
                c[1] = n
            elif n < c[2]:
                c[2] = n
    bk = [classes[k] for k in sorted(classes)]
    m = len(bk)
    if m == 1:
        return [(None, hi + 1, lo)]
    counts = [len(c[0]) for c in bk]
    Ts = [c[1] + 1 for c in bk]
    first = [c[0][0] for c in bk]     # rows are listed in ascending order
    last = [c[0][-1] for c in bk]
    inf = float("inf")
    # tail[a][g]: cheapest cost of classes a.. in g gathered groups (choice: where the first ends)
    tail = [[inf] * max_buckets for _ in range(m + 1)]
    cut = [[0] * max_buckets for _ in range(m + 1)]
    tail[m][0] = 0.0
    for a in range(m - 1, -1, -1):
        n, r0, r1 = 0, B, -1
        for b in range(a, m):
            n += counts[b]
            r0, r1 = min(r0, first[b]), max(r1, last[b])
            # rows in consecutive slots are read as a slice, without the gather
            group = (1.0 if r1 - r0 + 1 == n else gather) * n * Ts[b] + overhead
            for g in range(1, max_buckets):
                c = group + tail[b + 1][g - 1]
                if c < tail[a][g]:
                    tail[a][g], cut[a][g] = c, b + 1
    best, best_j, best_g = B * Ts[-1], m, 0          # the padded batch
    for j in range(1, m):
        for g in range(1, max_buckets):
            c = B * Ts[j - 1] + tail[j][g]
            if c < best:
                best, best_j, best_g = c, j, g
    out = [(None, Ts[best_j - 1], lo)]
    a, g = best_j, best_g
    while g:
        b = cut[a][g]
        rows = sorted(r for c in bk[a:b] for r in c[0])
        out.append((rows, max(c[1] for c in bk[a:b]) + 1, min(c[2] for c in bk[a:b])))
        a, g = b, g - 1
    return out
