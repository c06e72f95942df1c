# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""C twin of ``bridge.faults._python``: same functions, same results, same exceptions.

The per-rank loops live here (validation, formatting, strict parsing, merging,
FaultRank encoding and decoding), and the report requests' other fields, which are
written on the report's way from the controller's callback to the wire. Whenever an
input is not on the fast path (a non-dict mapping, an int subclass, a str subclass,
anything invalid) the work or the error message is handed to the reference module,
so both implementations accept exactly the same inputs and say exactly the same thing
about bad ones. ClusterD's duplicate rule is not restated here: the sticky type is read
from the reference module's ``_REPLACEABLE`` at import.
"""

from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.ref cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeASCII

from collections.abc import Mapping

from bridge.faults import _python as _py

cdef extern from *:
    """
    /* A dict sized for its final entry count skips every intermediate resize. */
    #if PY_VERSION_HEX < 0x030D0000
    #define bridge_new_dict(n) _PyDict_NewPresized(n)
    #else
    #define bridge_new_dict(n) PyDict_New()
    #endif

    /* Reads an exact int without a call when CPython stores it in at most two digits
       (every valid rank); returns 0 for anything else, which takes the general path. */
    static inline int bridge_read_small_int(PyObject* o, long long* out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject*)o)) return 0;
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject*)o);
        return 1;
    #else
        {
            const digit* d = ((PyLongObject*)o)->ob_digit;
            switch (Py_SIZE(o)) {
                case 0: *out = 0; return 1;
                case 1: *out = (long long)d[0]; return 1;
                case 2: *out = (long long)d[0] | ((long long)d[1] << PyLong_SHIFT); return 1;
                default: return 0;
            }
        }
    #endif
    }

    /* Digits of a rank without a branch per power of ten: the bit length times log10(2)
       (1233 / 4096) is the digit count or one more, and one table compare settles it.
       Random ranks mix digit counts, so a chain of compares mispredicts on every map. */
    static inline Py_ssize_t bridge_decimal_len(uint32_t v) {
        static const uint32_t floor_pow10[10] = {
            0, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000, 1000000000};
        uint32_t t = ((uint32_t)(32 - __builtin_clz(v | 1)) * 1233) >> 12;
        return (Py_ssize_t)t + 1 - (v < floor_pow10[t]);
    }

    /* The fault type whose cached int object ``v`` is (0, 1 or 2), or -1, told without a
       branch on which type it is: a map's types may come in no order the CPU can
       predict, and a mispredicted branch also throws away the reads of the entries after
       it. Where CPython keeps its small ints 0, 1 and 2 one after another, 32 bytes apart
       (every 64-bit build of 3.10-3.13; checked at import by ``bridge_set_type_layout``),
       the type is the object's offset from 0; elsewhere three comparisons. */
    static PyObject* bridge_type_base = NULL;

    static void bridge_set_type_layout(PyObject* t0, PyObject* t1, PyObject* t2) {
        bridge_type_base = ((char*)t1 - (char*)t0 == 32 && (char*)t2 - (char*)t1 == 32) ? t0 : NULL;
    }

    static inline int bridge_type_of(PyObject* v, PyObject* const* types) {
        const char* base = (const char*)bridge_type_base;
        if (base != NULL) {
            size_t d = (size_t)((const char*)v - base);
            return (d & 31) == 0 && d <= 64 ? (int)(d >> 5) : -1;
        }
        return v == types[0] ? 0 : v == types[1] ? 1 : v == types[2] ? 2 : -1;
    }

    /* Asks the CPU to bring the cache line at ``p`` in; never faults, whatever ``p`` is. */
    #define bridge_prefetch(p) __builtin_prefetch((const void*)(p), 0, 3)

    /* A combined dict's entry table, in insertion order, read in place: what PyDict_Next
       walks, without a call per entry. No public API gives it, so the layout is CPython's
       own (Include/internal/pycore_dict.h on 3.11-3.13, Objects/dict-common.h on 3.10),
       taken only where it is known and only after ``bridge_check_entries`` found the
       table equal to PyDict_Next's walk at import; elsewhere NULL (walk with PyDict_Next). */
    typedef struct { Py_hash_t hash; PyObject* key; PyObject* value; } bridge_entry;
    typedef struct { Py_ssize_t refcnt; uint8_t log2_size; uint8_t log2_index_bytes; uint8_t kind;
                     uint32_t version; Py_ssize_t usable; Py_ssize_t nentries; char indices[1]; } bridge_keys_311;
    typedef struct { Py_ssize_t refcnt; Py_ssize_t size; void* lookup; Py_ssize_t usable;
                     Py_ssize_t nentries; char indices[1]; } bridge_keys_310;
    static int bridge_entries_trusted = 0;

    static const bridge_entry* bridge_layout_entries(PyObject* d, Py_ssize_t* count) {
    #if defined(Py_GIL_DISABLED) || PY_VERSION_HEX < 0x030A0000 || PY_VERSION_HEX >= 0x030E0000
        (void)d; (void)count;
        return NULL;
    #else
        PyDictObject* mp = (PyDictObject*)d;
        if (mp->ma_values != NULL) return NULL;  /* a split table */
      #if PY_VERSION_HEX >= 0x030B0000
        {
            const bridge_keys_311* keys = (const bridge_keys_311*)mp->ma_keys;
            if (keys->kind != 0) return NULL;  /* DICT_KEYS_GENERAL: every key not a str */
            *count = keys->nentries;
            return (const bridge_entry*)(keys->indices + ((size_t)1 << keys->log2_index_bytes));
        }
      #else
        {
            const bridge_keys_310* keys = (const bridge_keys_310*)mp->ma_keys;
            size_t size = (size_t)keys->size;
            size_t width = size <= 0xff ? 1 : size <= 0xffff ? 2 : size <= 0xffffffffu ? 4 : 8;
            *count = keys->nentries;
            return (const bridge_entry*)(keys->indices + size * width);
        }
      #endif
    #endif
    }

    static void bridge_distrust_entries(void) { bridge_entries_trusted = 0; }

    static inline const bridge_entry* bridge_dict_entries(PyObject* d, Py_ssize_t* count) {
        return bridge_entries_trusted ? bridge_layout_entries(d, count) : NULL;
    }

    /* Trusts the layout when, for ``d`` (a dict of int keys with deleted entries), the
       table holds exactly PyDict_Next's entries in its order; pointers are compared, never
       followed. Returns whether it is trusted. */
    static int bridge_check_entries(PyObject* d) {
        Py_ssize_t count = -1, pos = 0, at = 0;
        PyObject* key;
        PyObject* value;
        const bridge_entry* entries = bridge_layout_entries(d, &count);
        bridge_entries_trusted = 0;
        if (entries == NULL || count < PyDict_GET_SIZE(d) || count > 4 * PyDict_GET_SIZE(d) + 8) return 0;
        while (PyDict_Next(d, &pos, &key, &value)) {
            while (at < count && entries[at].value == NULL) at++;
            if (at == count || entries[at].key != key || entries[at].value != value) return 0;
            at++;
        }
        while (at < count && entries[at].value == NULL) at++;
        bridge_entries_trusted = (at == count);
        return bridge_entries_trusted;
    }
    """
    dict _new_dict "bridge_new_dict"(Py_ssize_t)
    Py_ssize_t _decimal_len "bridge_decimal_len"(uint32_t) noexcept
    int _type_of "bridge_type_of"(PyObject*, PyObject**) noexcept
    void _set_type_layout "bridge_set_type_layout"(PyObject*, PyObject*, PyObject*) noexcept
    PyObject* _type_base "bridge_type_base"
    bint _read_small_int "bridge_read_small_int"(PyObject*, long long*)
    void _prefetch "bridge_prefetch"(const void*) noexcept
    ctypedef struct Entry "bridge_entry":
        PyObject* key
        PyObject* value
    const Entry* _dict_entries "bridge_dict_entries"(PyObject*, Py_ssize_t*) noexcept
    int _check_entries "bridge_check_entries"(PyObject*) except -1
    void _distrust_entries "bridge_distrust_entries"() noexcept

cdef extern from *:
    int __builtin_clzll(unsigned long long) noexcept nogil

cdef extern from "Python.h":
    bint _int_exact "PyLong_CheckExact"(PyObject*)
    int _dict_next "PyDict_Next"(object, Py_ssize_t*, PyObject**, PyObject**)
    PyObject* _set_default "PyDict_SetDefault"(object, PyObject*, PyObject*) except NULL
    int _dict_set "PyDict_SetItem"(object, PyObject*, PyObject*) except -1
    int PyUnicode_IS_ASCII(object)
    PyObject* _new_bytes "PyBytes_FromStringAndSize"(const char*, Py_ssize_t)
    char* _bytes_data "PyBytes_AS_STRING"(PyObject*)
    int _bytes_resize "_PyBytes_Resize"(PyObject**, Py_ssize_t)
    void _decref "Py_DECREF"(PyObject*)

cdef enum:
    MAX_RANK = 2147483647

cdef object _TYPES = (0, 1, 2)
# Borrowed pointers to CPython's cached 0, 1 and 2 (kept alive by _TYPES): merged values
# are always these objects, so "stored type is sticky" is a pointer comparison.
cdef PyObject* _TYPE_OBJ[3]
_TYPE_OBJ[0] = <PyObject*>_TYPES[0]
_TYPE_OBJ[1] = <PyObject*>_TYPES[1]
_TYPE_OBJ[2] = <PyObject*>_TYPES[2]


def _type_by_offset(enabled=True):
    """Tell a fault type by its object's offset from CPython's cached 0 when the layout
    allows and ``enabled`` (False: by comparisons, which the tests also run); True when
    it is told by offset."""
    if enabled:
        _set_type_layout(_TYPE_OBJ[0], _TYPE_OBJ[1], _TYPE_OBJ[2])
    else:
        _set_type_layout(_TYPE_OBJ[0], _TYPE_OBJ[0], _TYPE_OBJ[0])  # no stride: comparisons
    return _type_base != NULL


_TYPES_BY_OFFSET = _type_by_offset()


def _sticky_type():
    """The one fault type ClusterD's duplicate rule never replaces, read from the rule's
    home in the reference module, so the twins cannot disagree about it."""
    sticky = [t for t in _TYPES if t not in _py._REPLACEABLE]
    if len(sticky) != 1:
        raise ImportError(f"the C fault codec handles exactly one sticky fault type, not {sticky}")
    return sticky[0]


cdef int _STICKY = _sticky_type()
cdef PyObject* _STICKY_OBJ = _TYPE_OBJ[_STICKY]


# --------------------------------------------------------------------------- entries
# The pure-C helpers below are ``noexcept``: for a cdef function returning void or a C
# value without it, Cython 3 checks ``PyErr_Occurred()`` after every call, which in the
# encoder's loop was a libpython call per rank.

cdef inline bint _fast(PyObject* key, PyObject* value, long long* rank, int* ftype) noexcept:
    """True when both are exact ints in range (the only case handled without Python); the
    type is told without a branch on it where the layout allows (``bridge_type_of``)."""
    cdef long long r
    cdef int t = _type_of(value, _TYPE_OBJ)
    if t < 0:
        return False
    ftype[0] = t
    if not _read_small_int(key, &r) or r < 0 or r > MAX_RANK:
        return False
    rank[0] = r
    return True


cdef inline int _entry(PyObject* key, PyObject* value, long long* rank, int* ftype) except -1:
    """Validate one entry, delegating int-likes and errors to the reference check."""
    if _fast(key, value, rank, ftype):
        return 0
    return _slow_entry(key, value, rank, ftype)


cdef int _slow_entry(PyObject* key, PyObject* value, long long* rank, int* ftype) except -1:
    r, t = _py._checked(<object>key, <object>value)
    rank[0] = r
    ftype[0] = t
    return 0


cdef dict _as_dict(object faults):
    if isinstance(faults, dict):
        return <dict>faults
    if isinstance(faults, Mapping):
        return dict(faults)
    raise _py.not_a_map_error(faults)


cdef inline int _merge_one(dict merged, object rank_obj, int ftype) except -1:
    """ClusterD's rule (``_py._merge_into``): a stored sticky type stays, otherwise the
    later type wins."""
    cdef PyObject* value = _TYPE_OBJ[ftype]
    cdef PyObject* stored = _set_default(merged, <PyObject*>rank_obj, value)
    if stored != value and stored != _STICKY_OBJ:
        _dict_set(merged, <PyObject*>rank_obj, value)
    return 0


cdef inline object _rank_object(PyObject* key, long long rank):
    return <object>key if _int_exact(key) else rank


# --------------------------------------------------------------------------- walking large maps
# A map's int keys lie wherever the process allocated them; above the CPU's cache,
# reading each one is a memory round trip, and the loops over a map waited for them one
# by one, after a PyDict_Next call each. Where CPython's layout is known (``_dict_entries``)
# the loops read the entry table in place and ask the CPU for the key ``AHEAD`` entries on,
# so those round trips overlap. No Python code runs while they hold the table's pointer:
# they only take exact int entries, an entry that is not one sends the caller back to the
# general PyDict_Next loop from the start, and what they insert goes into a dict the codec
# made, of exact int keys. Elsewhere the PyDict_Next loops do the same work unhurried.

cdef enum:
    AHEAD = 16
    CHUNK = 256
    SHORT_SORT = 4096


def _trust_entry_tables(enabled=True):
    """Read entry tables in place only if CPython's layout is the one expected (checked
    on a dict with deleted entries) and ``enabled`` (False: the PyDict_Next loops, which
    the tests also run); True when they are read in place."""
    sample = {rank * 7919: rank % 3 for rank in range(300)}
    for rank in range(0, 300, 7):
        del sample[rank * 7919]
    if not enabled:
        _distrust_entries()
        return False
    return bool(_check_entries(<PyObject*>sample))


_ENTRY_TABLES_READ_IN_PLACE = _trust_entry_tables()


cdef bint _merge_walk(dict merged, dict source) except -1:
    """Merge every entry of ``source`` into ``merged``; False at the first one that is not
    an exact int pair in range (the entries before it are merged already). ``merged``
    must hold exact int keys only, so that no insert runs Python code.

    ``CHUNK`` entries at a time are first read, then inserted: the reads, with nothing
    between them, keep the memory busy with the next keys' round trips, which the dict
    work of an insert between two reads would hold up."""
    cdef PyObject* keys[CHUNK]
    cdef int types[CHUNK]
    cdef Py_ssize_t count = 0, start = 0, i, j, filled
    cdef Py_ssize_t pos = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype
    cdef const Entry* entries = _dict_entries(<PyObject*>source, &count)
    if entries == NULL:
        while _dict_next(source, &pos, &key, &value):
            if not _fast(key, value, &rank, &ftype):
                return False
            _merge_one(merged, <object>key, ftype)
        return True
    for i in range(min(count, AHEAD)):
        _prefetch(entries[i].key)
    while start < count:
        filled = 0
        i = start
        while i < count and filled < CHUNK:
            if i + AHEAD < count:
                _prefetch(entries[i + AHEAD].key)
            value = entries[i].value
            if value != NULL:  # NULL: a deleted entry
                if not _fast(entries[i].key, value, &rank, &ftype):
                    for j in range(filled):
                        _merge_one(merged, <object>keys[j], types[j])
                    return False
                keys[filled] = entries[i].key
                types[filled] = ftype
                filled += 1
            i += 1
        start = i
        for j in range(filled):
            _merge_one(merged, <object>keys[j], types[j])
    return True


# --------------------------------------------------------------------------- sorting

cdef inline bint _radix_pass(const uint64_t* src, uint64_t* dst, Py_ssize_t n, int shift, int width) noexcept:
    """One stable counting pass of ``src`` into ``dst`` by the ``width`` bits at ``shift``;
    False, and nothing written, when every word has the same digit there."""
    cdef Py_ssize_t counts[2048]
    cdef Py_ssize_t i, j, total = 0, c
    cdef Py_ssize_t buckets = (<Py_ssize_t>1) << width
    cdef uint64_t mask = <uint64_t>(buckets - 1)
    memset(counts, 0, buckets * sizeof(Py_ssize_t))
    for i in range(n):
        counts[(src[i] >> shift) & mask] += 1
    if counts[(src[0] >> shift) & mask] == n:
        return False
    for i in range(buckets):
        c = counts[i]
        counts[i] = total
        total += c
    for i in range(n):
        j = <Py_ssize_t>((src[i] >> shift) & mask)
        dst[counts[j]] = src[i]
        counts[j] += 1
    return True


cdef void _sort_by_rank(uint64_t* items, uint64_t* scratch, Py_ssize_t n) noexcept:
    """Stable sort of ``rank << 2 | type`` words by rank: insertion sort for short maps,
    otherwise LSD radix passes, less a pass whose digit is the same in every word: 8-bit
    digits over the bits below the highest rank's for a few thousand words (the count
    table's set-up is most of a pass there), three 11-bit ones above (ranks fit 31 bits)."""
    cdef Py_ssize_t i, j
    cdef uint64_t item, highest = 0
    cdef int shift, top
    cdef uint64_t* src = items
    cdef uint64_t* dst = scratch
    cdef uint64_t* tmp
    if n < 64:
        for i in range(1, n):
            item = items[i]
            j = i - 1
            while j >= 0 and (items[j] >> 2) > (item >> 2):
                items[j + 1] = items[j]
                j -= 1
            items[j + 1] = item
        return
    if n < SHORT_SORT:
        for i in range(n):
            highest |= items[i]
        top = 64 - __builtin_clzll(highest | 4)
        for shift in range(2, top, 8):
            if _radix_pass(src, dst, n, shift, 8):
                tmp = src
                src = dst
                dst = tmp
    else:
        for shift in range(2, 35, 11):
            if _radix_pass(src, dst, n, shift, 11):
                tmp = src
                src = dst
                dst = tmp
    if src != items:
        memcpy(items, src, n * sizeof(uint64_t))


cdef const char* _PAIRS = (
    b"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    b"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    b"8081828384858687888990919293949596979899"
)


cdef inline void _write_digits(char* out, uint32_t value, Py_ssize_t n) noexcept:
    """Write the ``n`` decimal digits of ``value`` two at a time, from the right.

    The table is read through a local: a store through ``char*`` may alias any global,
    so the compiler would otherwise reload ``_PAIRS`` after every digit it writes, and
    two-byte copies are single moves."""
    cdef const char* pairs = _PAIRS
    cdef uint32_t pair
    while value >= 100:
        pair = (value % 100) * 2
        value //= 100
        n -= 2
        memcpy(out + n, pairs + pair, 2)
    if value >= 10:
        memcpy(out + n - 2, pairs + value * 2, 2)
    else:
        out[n - 1] = <char>(48 + value)


cdef inline Py_ssize_t _write_decimal(char* out, uint32_t value) noexcept:
    cdef Py_ssize_t n = _decimal_len(value)
    _write_digits(out, value, n)
    return n


# --------------------------------------------------------------------------- strings

def format_faults(faults):
    cdef dict source = _as_dict(faults)
    cdef Py_ssize_t n = len(source), pos = 0, count = 0, i, length = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype
    cdef bint sorted_already = True
    cdef uint64_t* items
    cdef char* out
    cdef const Entry* entries
    cdef Py_ssize_t table = 0
    if n == 0:
        return ""
    items = <uint64_t*>malloc(2 * n * sizeof(uint64_t))
    out = <char*>malloc(n * 13)
    if items == NULL or out == NULL:
        free(items)
        free(out)
        raise MemoryError()
    try:
        entries = _dict_entries(<PyObject*>source, &table)
        if entries == NULL:
            count = -1
        for i in range(min(table, AHEAD)):
            _prefetch(entries[i].key)
        for i in range(table):
            if i + AHEAD < table:
                _prefetch(entries[i + AHEAD].key)
            value = entries[i].value
            if value == NULL:  # a deleted entry
                continue
            if not _fast(entries[i].key, value, &rank, &ftype):
                count = -1
                break
            items[count] = (<uint64_t>rank) << 2 | <uint64_t>ftype
            if count and (items[count - 1] >> 2) > <uint64_t>rank:
                sorted_already = False
            count += 1
        if count < 0:  # not all exact ints: the general loop, from the start
            count = 0
            sorted_already = True
            while _dict_next(source, &pos, &key, &value):
                _entry(key, value, &rank, &ftype)
                items[count] = (<uint64_t>rank) << 2 | <uint64_t>ftype
                if count and (items[count - 1] >> 2) > <uint64_t>rank:
                    sorted_already = False
                count += 1
        if not sorted_already:
            _sort_by_rank(items, items + n, count)
        i = 0
        while i < count:
            rank = <long long>(items[i] >> 2)
            ftype = <int>(items[i] & 3)
            i += 1
            while i < count and <long long>(items[i] >> 2) == rank:  # int-likes collided
                if ftype != _STICKY:
                    ftype = <int>(items[i] & 3)
                i += 1
            if length:
                out[length] = 44  # ','
                length += 1
            length += _write_decimal(out + length, <uint32_t>rank)
            out[length] = 58  # ':'
            out[length + 1] = <char>(48 + ftype)
            length += 2
        return PyUnicode_DecodeASCII(out, length, NULL)
    finally:
        free(items)
        free(out)


def parse_faults(text, *, strict=True):
    cdef Py_ssize_t size = 0, i = 0
    cdef const char* data
    cdef long long rank
    cdef int digits
    cdef unsigned char ch
    cdef dict faults
    if not isinstance(text, str):
        raise _py.not_a_string_error(text)
    if not strict:
        return _py.clusterd_parse(text)
    if not PyUnicode_IS_ASCII(text):
        raise _py.strict_error(text)
    data = PyUnicode_AsUTF8AndSize(text, &size)
    faults = _new_dict((size + 1) // 4)  # "r:t," is the shortest element
    if size == 0:
        return faults
    while True:
        rank = 0
        digits = 0
        while i < size and 48 <= <unsigned char>data[i] <= 57:
            if rank <= MAX_RANK:
                rank = rank * 10 + (data[i] - 48)
            digits += 1
            i += 1
        if (digits == 0 or rank > MAX_RANK or i + 1 >= size or data[i] != 58
                or not 48 <= <unsigned char>data[i + 1] <= 50):
            raise _py.strict_error(text)
        _merge_one(faults, rank, data[i + 1] - 48)
        i += 2
        if i == size:
            return faults
        if data[i] != 44 or i + 1 == size:
            raise _py.strict_error(text)
        i += 1


cdef bint _all_fast(dict source) noexcept:
    """True when every entry is an exact in-range int pair (it can then be copied as is)."""
    cdef Py_ssize_t pos = 0, count = 0, i
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype
    cdef const Entry* entries = _dict_entries(<PyObject*>source, &count)
    if entries == NULL:
        while _dict_next(source, &pos, &key, &value):
            if not _fast(key, value, &rank, &ftype):
                return False
        return True
    for i in range(min(count, AHEAD)):
        _prefetch(entries[i].key)
    for i in range(count):
        if i + AHEAD < count:
            _prefetch(entries[i + AHEAD].key)
        value = entries[i].value
        if value != NULL and not _fast(entries[i].key, value, &rank, &ftype):
            return False
    return True


def merge_faults(*maps):
    cdef dict merged
    cdef dict source
    cdef Py_ssize_t pos, first = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype
    cdef Py_ssize_t total = 0
    for faults in maps:
        if type(faults) is not dict:
            break
        total += len(<dict>faults)
    else:  # exact dicts: the fast walk, unless an entry is not an exact int pair
        if maps and _all_fast(<dict>maps[0]):
            merged = (<dict>maps[0]).copy()  # a dict copy is far cheaper than re-inserting
            first = 1
        else:
            merged = _new_dict(total)
        for faults in maps[first:]:
            if not _merge_walk(merged, <dict>faults):
                break
        else:
            return merged
        first = 0
    merged = _new_dict(sum([len(m) for m in maps if isinstance(m, dict)]))
    for faults in maps[first:]:
        source = _as_dict(faults)
        pos = 0
        while _dict_next(source, &pos, &key, &value):
            _entry(key, value, &rank, &ftype)
            _merge_one(merged, _rank_object(key, rank), ftype)
    return merged


def merge_faults_into(target, *maps):
    cdef dict source
    cdef Py_ssize_t pos
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype = 0
    if type(target) is not dict:
        return _py.merge_faults_into(target, *maps)  # raises the reference error
    for faults in maps:
        if type(faults) is not dict or not _all_fast(<dict>faults):
            # Validate everything before touching ``target``, as the reference does. (Not
            # "fast" includes valid ranks CPython >= 3.12 stores in two digits, >= 2**30:
            # so the merged map is not re-checked with _all_fast, it is merged below.)
            maps = (merge_faults(*maps),)
            break
    # Merged with PyDict_Next, not a walk: ``target`` is the caller's, and a key of it that
    # compares with an int in Python could change a map under a walk's borrowed pointers.
    for faults in maps:
        source = <dict>faults
        pos = 0
        while _dict_next(source, &pos, &key, &value):
            _entry(key, value, &rank, &ftype)  # cannot fail: every entry was checked above
            _merge_one(target, _rank_object(key, rank), ftype)
    return target


# --------------------------------------------------------------------------- protobuf wire

cdef inline Py_ssize_t _write_varint(char* out, uint64_t value) noexcept:
    cdef Py_ssize_t n = 0
    while value > 0x7F:
        out[n] = <char>((value & 0x7F) | 0x80)
        value >>= 7
        n += 1
    out[n] = <char>value
    return n + 1


cdef inline Py_ssize_t _write_fault_rank(char* out, Py_ssize_t at, const char* tag, Py_ssize_t tag_len,
                                         long long rank, int ftype) noexcept:
    """One repeated FaultRank field at ``out + at``; returns where it ends."""
    cdef Py_ssize_t digits
    if tag_len == 1:  # every request's field (< 16): a store, not a memcpy call per rank
        out[at] = tag[0]
    else:
        memcpy(out + at, tag, tag_len)
    at += tag_len
    digits = _decimal_len(<uint32_t>rank)
    out[at] = <char>(digits + 5)  # FaultRank body: 0x0A len digits 0x12 0x01 type
    out[at + 1] = 0x0A
    out[at + 2] = <char>digits
    _write_digits(out + at + 3, <uint32_t>rank, digits)
    at += 3 + digits
    out[at] = 0x12
    out[at + 1] = 1
    out[at + 2] = <char>(48 + ftype)
    return at + 3


cdef bytes _framed(bytes prefix, object faults, int field_number, bytes suffix):
    """``prefix`` + the repeated FaultRank field + ``suffix`` as one bytes object.

    One pass over the map writes straight into a bytes object sized for the longest
    possible encoding, which is then shrunk in place: each rank is read once and the
    encoded ranks are never copied.
    """
    cdef dict source = _as_dict(faults)
    cdef Py_ssize_t n = len(source), pos = 0, digits, at
    cdef Py_ssize_t head = len(prefix), tail = len(suffix)
    cdef PyObject* key
    cdef PyObject* value
    cdef long long rank
    cdef int ftype
    cdef char tag[5]
    cdef Py_ssize_t tag_len = _write_varint(tag, (<uint64_t>field_number) << 3 | 2)
    cdef PyObject* raw = _new_bytes(NULL, head + n * (tag_len + 16) + tail)
    cdef char* out
    cdef const Entry* entries
    cdef Py_ssize_t count = 0, i
    if raw == NULL:
        raise MemoryError()
    try:
        out = _bytes_data(raw)
        memcpy(out, <char*>prefix, head)
        at = head
        entries = _dict_entries(<PyObject*>source, &count)
        if entries == NULL:
            at = -1
        for i in range(min(count, AHEAD)):
            _prefetch(entries[i].key)
        for i in range(count):
            if i + AHEAD < count:
                _prefetch(entries[i + AHEAD].key)
            value = entries[i].value
            if value == NULL:  # a deleted entry
                continue
            if not _fast(entries[i].key, value, &rank, &ftype):
                at = -1
                break
            at = _write_fault_rank(out, at, tag, tag_len, rank, ftype)
        if at < 0:  # not all exact ints: the general loop, from the start
            at = head
            while _dict_next(source, &pos, &key, &value):
                _entry(key, value, &rank, &ftype)
                at = _write_fault_rank(out, at, tag, tag_len, rank, ftype)
        memcpy(out + at, <char*>suffix, tail)
    except BaseException:
        _decref(raw)
        raise
    if _bytes_resize(&raw, at + tail) < 0:  # frees ``raw`` on failure
        raise MemoryError()
    result = <bytes>raw  # takes a new reference ...
    _decref(raw)  # ... so drop the one _new_bytes gave us
    return result


def encode_fault_ranks(faults, field_number):
    if type(field_number) is not int or not 1 <= field_number < 2 ** 29:
        return _py.encode_fault_ranks(faults, field_number)  # raises the reference error
    return _framed(b"", faults, field_number, b"")


# The head and tail fields of the report requests (job id, Status, strategy, string
# lists). Each report the bridge sends is encoded on the thread that makes the call, between
# the controller's callback and the wire, where every Python frame is paid for in latency;
# so the common case (exact str and int arguments) is written here, and anything else
# (a str subclass, an int-like, a bad value) is handed to the reference, which produces
# the same bytes or raises its own error.

cdef bytes _len_field(uint64_t number, const char* data, Py_ssize_t size):
    """One length-delimited field: tag, length, ``size`` bytes of ``data``."""
    cdef char head[20]
    cdef Py_ssize_t at = _write_varint(head, number << 3 | 2)
    at += _write_varint(head + at, <uint64_t>size)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, at + size)
    cdef char* buffer = <char*>out
    memcpy(buffer, head, at)
    if size:
        memcpy(buffer + at, data, size)
    return out


cdef bytes _string_field(uint64_t number, object text):
    """A proto3 string field; the empty string is the default and is not written."""
    cdef const char* data
    cdef Py_ssize_t size
    if type(text) is not str:
        return _py._string_field(number, _py._require_str(text))
    if not text:
        return b""
    data = PyUnicode_AsUTF8AndSize(text, &size)
    return _len_field(number, data, size)


cdef bytes _status_field(object code, object info):
    """``Status`` as field 2, always present (``_py._status_field`` says why)."""
    cdef char body[11]
    cdef Py_ssize_t size = 0
    cdef long long value
    if type(code) is not int or type(info) is not str or not -2**31 <= code < 2**31:
        return _py._status_field(code, info)
    value = code
    if value:
        body[0] = 0x08  # field 1, varint; a negative int32 is sign-extended to ten bytes
        size = 1 + _write_varint(body + 1, <uint64_t>value)
    inner = PyBytes_FromStringAndSize(body, size) + _string_field(2, info)
    return _len_field(2, <char*>inner, len(inner))


cdef bytes _strings(uint64_t number, object values):
    """A repeated string field: every element is written, empty ones too."""
    cdef const char* data
    cdef Py_ssize_t size
    if type(values) is not list and type(values) is not tuple:
        return _py._strings(number, values)
    for value in values:
        if type(value) is not str:
            return _py._strings(number, values)  # raises the reference error
    parts = []
    for value in values:
        data = PyUnicode_AsUTF8AndSize(value, &size)
        parts.append(_len_field(number, data, size))
    return b"".join(parts)


def encode_process_fault_request(job_id, faults):
    return _framed(_string_field(1, job_id), faults, 2, b"")


def encode_stop_complete_request(job_id, code, info, faults):
    head = _string_field(1, job_id) + _status_field(code, info)
    return _framed(head, faults, 3, b"")


def encode_recover_strategy_request(job_id, faults, strategies):
    return _framed(_string_field(1, job_id), faults, 2, _strings(3, strategies))


def encode_recover_status_request(job_id, code, info, strategy, isolate_rank_ids=()):
    return (_string_field(1, job_id) + _status_field(code, info) + _string_field(3, strategy)
            + _strings(4, isolate_rank_ids))


# --------------------------------------------------------------------------- decoding

cdef inline bint _varint_at(const unsigned char* data, Py_ssize_t size, Py_ssize_t* pos,
                            uint64_t* value) noexcept:
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef unsigned char byte
    while True:
        if pos[0] >= size or shift > 63:
            return False
        byte = data[pos[0]]
        pos[0] += 1
        result |= (<uint64_t>(byte & 0x7F)) << shift
        if not byte & 0x80:
            value[0] = result
            return True
        shift += 7


cdef inline bint _skip_field(const unsigned char* data, Py_ssize_t size, Py_ssize_t* pos,
                             int wire_type, Py_ssize_t* start) noexcept:
    """Advance past one field's payload; ``start`` receives where the payload begins."""
    cdef uint64_t length
    if wire_type == 0:
        start[0] = pos[0]
        return _varint_at(data, size, pos, &length)
    if wire_type == 2:
        if not _varint_at(data, size, pos, &length) or length > <uint64_t>(size - pos[0]):
            return False
        start[0] = pos[0]
        pos[0] += <Py_ssize_t>length
        return True
    start[0] = pos[0]
    if wire_type == 1:
        pos[0] += 8
    elif wire_type == 5:
        pos[0] += 4
    else:
        return False
    return pos[0] <= size


cdef inline bint _fault_rank_at(const unsigned char* data, Py_ssize_t start, Py_ssize_t end,
                                long long* rank, int* ftype) noexcept:
    """Decode one FaultRank body; False when malformed or not a valid rank/type."""
    cdef Py_ssize_t pos = start, payload, i
    cdef uint64_t key
    cdef Py_ssize_t rank_start = -1, rank_end = -1, type_start = -1, type_end = -1
    cdef long long value = 0
    if end - start >= 8 and data[start] == 0x0A:  # the layout every encoder writes
        payload = data[start + 1]
        if (1 <= payload <= 10 and start + 5 + payload == end and data[start + 2 + payload] == 0x12
                and data[start + 3 + payload] == 1):
            rank_start, rank_end = start + 2, start + 2 + payload
            type_start, type_end = rank_end + 2, end
            pos = end
    while pos < end:
        if not _varint_at(data, end, &pos, &key) or (key >> 3) == 0:
            return False
        if not _skip_field(data, end, &pos, <int>(key & 7), &payload):
            return False
        if (key & 7) == 2 and (key >> 3) == 1:
            rank_start, rank_end = payload, pos
        elif (key & 7) == 2 and (key >> 3) == 2:
            type_start, type_end = payload, pos
    if rank_start < 0 or rank_end - rank_start < 1 or rank_end - rank_start > 10:
        return False
    if type_end - type_start != 1 or not 48 <= data[type_start] <= 50:
        return False
    for i in range(rank_start, rank_end):
        if not 48 <= data[i] <= 57:
            return False
        value = value * 10 + (data[i] - 48)
    if value > MAX_RANK:
        return False
    rank[0] = value
    ftype[0] = data[type_start] - 48
    return True


def decode_signal_faults(data):
    cdef bytes raw = bytes(data)
    cdef const unsigned char* buf = raw
    cdef Py_ssize_t size = len(raw), pos = 0, payload
    cdef uint64_t key
    cdef long long rank
    cdef int ftype
    cdef dict faults = _new_dict(size // 8)  # a FaultRank entry takes at least 8 bytes
    while pos < size:
        if buf[pos] == 0x2A and pos + 1 < size and buf[pos + 1] < 0x80:  # short faultRanks entry
            payload = pos + 2
            pos = payload + buf[pos + 1]
            if pos > size:
                return _py.decode_signal_faults(raw)  # raises the reference error
        else:
            if not _varint_at(buf, size, &pos, &key) or (key >> 3) == 0:
                return _py.decode_signal_faults(raw)
            if not _skip_field(buf, size, &pos, <int>(key & 7), &payload):
                return _py.decode_signal_faults(raw)
            if (key >> 3) != 5 or (key & 7) != 2:
                continue
        if not _fault_rank_at(buf, payload, pos, &rank, &ftype):
            return _py.decode_signal_faults(raw)
        _merge_one(faults, rank, ftype)
    return faults
