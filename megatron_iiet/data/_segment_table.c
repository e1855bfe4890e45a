/* The segment table of megatron_iiet.data.bpe_cache: cut texts into segments, look them up and
 * join their memoised token ids, with no Python object per segment.
 *
 * A text is cut between two characters a, b when no vocabulary piece holds "ab" (bpe_cache.py says
 * why each segment then encodes on its own exactly as it does inside the text), except, when the
 * table is given the characters that are vocabulary pieces, between two characters that are not
 * (sentencepiece without byte fallback turns a run of those into one <unk>). Keys are the UTF-8
 * bytes of a segment; values its ids, already in the output dtype's bytes. The table grows up to
 * `max_entries` segments of at most `max_key_chars` characters and never evicts, so its memory is
 * bounded. Protocol per batch: scan(texts) -> missing segments; the caller encodes those and passes
 * them to add() (kept while there is room) and join() (each text's ids).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A slot holds the upper half of the key's hash (never 0: 0 marks an empty slot) and the offset
 * of its record in the arena: [uint32 key length][uint32 value length][key][value]. Two memory
 * reads per lookup, 8 bytes a slot: the table stays small enough to keep mostly in cache. */
typedef struct {
    uint32_t tag, offset;
} Slot;

typedef struct {
    Slot *slots;
    size_t mask, count;
    char *arena;
    size_t arena_len, arena_cap;
} Table;

#define ARENA_LIMIT ((size_t)1 << 31) /* offsets fit 31 bits: a ref's top bit marks a missing key */

static uint64_t hash_bytes(const char *p, Py_ssize_t n)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a, then a 64-bit finaliser for the low bits */
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 1099511628211ULL;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return h;
}

static uint32_t tag_of(uint64_t hash)
{
    return (uint32_t)(hash >> 32) | 1;
}

static int table_init(Table *t, size_t slots)
{
    memset(t, 0, sizeof(*t));
    t->slots = PyMem_Calloc(slots, sizeof(Slot));
    if (!t->slots) {
        PyErr_NoMemory();
        return -1;
    }
    t->mask = slots - 1;
    return 0;
}

static void table_free(Table *t)
{
    PyMem_Free(t->slots);
    PyMem_Free(t->arena);
    memset(t, 0, sizeof(*t));
}

static uint32_t record_key_len(const Table *t, uint32_t offset)
{
    uint32_t len;
    memcpy(&len, t->arena + offset, 4);
    return len;
}

/* The record offset of `key`, or -1. */
static int64_t table_find(const Table *t, const char *key, Py_ssize_t len, uint64_t hash)
{
    uint32_t tag = tag_of(hash);
    for (size_t i = hash & t->mask;; i = (i + 1) & t->mask) {
        const Slot *slot = &t->slots[i];
        if (slot->tag == 0)
            return -1;
        if (slot->tag == tag && record_key_len(t, slot->offset) == (uint32_t)len &&
            memcmp(t->arena + slot->offset + 8, key, len) == 0)
            return slot->offset;
    }
}

static int append(char **buffer, size_t *len, size_t *cap, const char *data, size_t n)
{
    if (*len + n > *cap) {
        size_t cap_new = *cap ? *cap : 4096;
        while (cap_new < *len + n)
            cap_new *= 2;
        char *grown = PyMem_Realloc(*buffer, cap_new);
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        *buffer = grown;
        *cap = cap_new;
    }
    memcpy(*buffer + *len, data, n);
    *len += n;
    return 0;
}

static int table_grow(Table *t)
{
    size_t slots = (t->mask + 1) * 2;
    Slot *grown = PyMem_Calloc(slots, sizeof(Slot));
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= t->mask; i++) {
        if (t->slots[i].tag == 0)
            continue;
        uint32_t offset = t->slots[i].offset;
        size_t j = hash_bytes(t->arena + offset + 8, record_key_len(t, offset)) & (slots - 1);
        while (grown[j].tag != 0)
            j = (j + 1) & (slots - 1);
        grown[j] = t->slots[i];
    }
    PyMem_Free(t->slots);
    t->slots = grown;
    t->mask = slots - 1;
    return 0;
}

/* Insert a key known to be absent: 0, or 1 when the arena is at its limit (nothing added), or
 * -1 with an exception set. */
static int table_insert(Table *t, const char *key, Py_ssize_t len, uint64_t hash, const char *val, Py_ssize_t val_len)
{
    size_t record = 8 + (size_t)len + (size_t)val_len;
    if (t->arena_len + record >= ARENA_LIMIT)
        return 1;
    if ((t->count + 1) * 2 > t->mask + 1 && table_grow(t) < 0)
        return -1;
    uint32_t offset = (uint32_t)t->arena_len, lengths[2] = {(uint32_t)len, (uint32_t)val_len};
    if (append(&t->arena, &t->arena_len, &t->arena_cap, (const char *)lengths, 8) < 0 ||
        append(&t->arena, &t->arena_len, &t->arena_cap, key, len) < 0 ||
        append(&t->arena, &t->arena_len, &t->arena_cap, val, val_len) < 0)
        return -1;
    size_t i = hash & t->mask;
    while (t->slots[i].tag != 0)
        i = (i + 1) & t->mask;
    t->slots[i].tag = tag_of(hash);
    t->slots[i].offset = offset;
    t->count++;
    return 0;
}

/* An open-addressing set of nonzero uint64 keys. */
typedef struct {
    uint64_t *keys;
    size_t mask;
} KeySet;

static size_t keyset_slot(uint64_t key, size_t mask)
{
    return (key * 0x9E3779B97F4A7C15ULL) >> 20 & mask;
}

static int keyset_init(KeySet *set, Py_ssize_t count)
{
    size_t slots = 16;
    while (slots < 2 * (size_t)count)
        slots *= 2;
    set->keys = PyMem_Calloc(slots, sizeof(uint64_t));
    if (!set->keys) {
        PyErr_NoMemory();
        return -1;
    }
    set->mask = slots - 1;
    return 0;
}

static void keyset_add(KeySet *set, uint64_t key)
{
    size_t i = keyset_slot(key, set->mask);
    while (set->keys[i] != 0 && set->keys[i] != key)
        i = (i + 1) & set->mask;
    set->keys[i] = key;
}

static int keyset_has(const KeySet *set, uint64_t key)
{
    for (size_t i = keyset_slot(key, set->mask);; i = (i + 1) & set->mask) {
        if (set->keys[i] == key)
            return 1;
        if (set->keys[i] == 0)
            return 0;
    }
}

/* Character pairs that some vocabulary piece holds, U+2581 read as a space: ASCII pairs in a bit
 * matrix, the others in a set of (a << 32 | b | 1 << 63). */
typedef struct {
    uint8_t ascii[128 * 128 / 8];
    KeySet pairs;
} Joinable;

static int joinable_init(Joinable *j, const uint32_t *pairs, Py_ssize_t count)
{
    memset(j->ascii, 0, sizeof(j->ascii));
    if (keyset_init(&j->pairs, count) < 0)
        return -1;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint32_t a = pairs[2 * k], b = pairs[2 * k + 1];
        if (a < 128 && b < 128)
            j->ascii[(a * 128 + b) >> 3] |= (uint8_t)(1u << ((a * 128 + b) & 7));
        else
            keyset_add(&j->pairs, (uint64_t)a << 32 | b | 1ULL << 63);
    }
    return 0;
}

static int joinable(const Joinable *j, uint32_t a, uint32_t b)
{
    if (a < 128 && b < 128)
        return j->ascii[(a * 128 + b) >> 3] >> ((a * 128 + b) & 7) & 1;
    return keyset_has(&j->pairs, (uint64_t)a << 32 | b | 1ULL << 63);
}

/* Characters that are vocabulary pieces (U+2581 read as a space), when a run of the others must
 * stay whole; `active` is 0 when no such set was given. */
typedef struct {
    int active;
    uint8_t ascii[128 / 8];
    KeySet chars;
} Known;

static int known_init(Known *k, const uint32_t *chars, Py_ssize_t count)
{
    memset(k->ascii, 0, sizeof(k->ascii));
    k->active = 1;
    if (keyset_init(&k->chars, count) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (chars[i] < 128)
            k->ascii[chars[i] >> 3] |= (uint8_t)(1u << (chars[i] & 7));
        else
            keyset_add(&k->chars, (uint64_t)chars[i] | 1ULL << 63);
    }
    return 0;
}

static int known(const Known *k, uint32_t c)
{
    if (c < 128)
        return k->ascii[c >> 3] >> (c & 7) & 1;
    return keyset_has(&k->chars, (uint64_t)c | 1ULL << 63);
}

/* Whether the text may be cut between a and b. */
static int cuttable(const Joinable *j, const Known *k, uint32_t a, uint32_t b)
{
    return !joinable(j, a, b) && (!k->active || known(k, a) || known(k, b));
}

/* The code point at s[*i] (valid UTF-8, as CPython makes it), advancing *i; U+2581 -> space. */
static uint32_t next_char(const unsigned char *s, Py_ssize_t *i)
{
    uint32_t c = s[*i];
    if (c < 0x80) {
        *i += 1;
        return c;
    }
    if (c < 0xE0) {
        c = (c & 0x1F) << 6 | (s[*i + 1] & 0x3F);
        *i += 2;
    } else if (c < 0xF0) {
        c = (c & 0x0F) << 12 | (s[*i + 1] & 0x3F) << 6 | (s[*i + 2] & 0x3F);
        *i += 3;
    } else {
        c = (c & 0x07) << 18 | (s[*i + 1] & 0x3F) << 12 | (s[*i + 2] & 0x3F) << 6 | (s[*i + 3] & 0x3F);
        *i += 4;
    }
    return c == 0x2581 ? ' ' : c;
}

static Py_ssize_t utf8_chars(const char *p, Py_ssize_t n)
{
    Py_ssize_t chars = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        chars += ((unsigned char)p[i] & 0xC0) != 0x80;
    return chars;
}

#define MISSING_BIT 0x80000000u

typedef struct {
    PyObject_HEAD
    Table table;
    Joinable joinable;
    Known known;
    Py_ssize_t max_entries, max_key_chars;
    /* What the last scan() found, for the join() after it: a ref per segment (a record offset,
     * or MISSING_BIT | index into scan's `missing`) and where each text's refs end. */
    char *refs;
    size_t refs_len, refs_cap;
    Py_ssize_t *text_ends, scanned; /* scanned: texts in the last scan, -1 when none is pending */
    char *out;
    size_t out_len, out_cap;
} SegmentTable;

static void free_cut_rules(SegmentTable *self)
{
    PyMem_Free(self->joinable.pairs.keys);
    PyMem_Free(self->known.chars.keys);
    self->joinable.pairs.keys = NULL;
    self->known.chars.keys = NULL;
    self->known.active = 0;
}

static int SegmentTable_init(SegmentTable *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"joinable_pairs", "max_entries", "max_key_chars", "known_chars", NULL};
    Py_buffer pairs, chars = {0};
    PyObject *chars_arg = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*nn|O", names, &pairs, &self->max_entries, &self->max_key_chars,
                                     &chars_arg))
        return -1;
    int status = -1, have_chars = chars_arg != Py_None;
    if (have_chars && PyObject_GetBuffer(chars_arg, &chars, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&pairs);
        return -1;
    }
    if (self->max_entries < 0 || self->max_key_chars < 0 || self->max_key_chars > 4096)
        PyErr_SetString(PyExc_ValueError, "need max_entries >= 0 and 0 <= max_key_chars <= 4096");
    else if (pairs.len % 8)
        PyErr_SetString(PyExc_ValueError, "joinable_pairs: bytes of uint32 (a, b) pairs");
    else if (have_chars && chars.len % 4)
        PyErr_SetString(PyExc_ValueError, "known_chars: bytes of uint32 code points, or None");
    else {
        table_free(&self->table);
        free_cut_rules(self);
        self->scanned = -1;
        if (joinable_init(&self->joinable, (const uint32_t *)pairs.buf, pairs.len / 8) == 0 &&
            (!have_chars || known_init(&self->known, (const uint32_t *)chars.buf, chars.len / 4) == 0))
            status = table_init(&self->table, 1 << 12);
    }
    PyBuffer_Release(&pairs);
    if (have_chars)
        PyBuffer_Release(&chars);
    return status;
}

static void SegmentTable_dealloc(SegmentTable *self)
{
    table_free(&self->table);
    free_cut_rules(self);
    PyMem_Free(self->refs);
    PyMem_Free(self->text_ends);
    PyMem_Free(self->out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t SegmentTable_len(SegmentTable *self)
{
    return (Py_ssize_t)self->table.count;
}

static int check_initialised(SegmentTable *self)
{
    if (self->table.slots)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "SegmentTable.__init__ was not called");
    return -1;
}

/* The ref of one segment; a key in neither the table nor `seen` is added to `seen` and `missing`. */
static int scan_segment(SegmentTable *self, Table *seen, PyObject *missing, const char *key, Py_ssize_t key_len)
{
    uint64_t hash = hash_bytes(key, key_len);
    int64_t offset = table_find(&self->table, key, key_len, hash);
    uint32_t ref;
    if (offset >= 0) {
        ref = (uint32_t)offset;
    } else if ((offset = table_find(seen, key, key_len, hash)) >= 0) {
        memcpy(&ref, seen->arena + offset + 8 + key_len, 4);
        ref |= MISSING_BIT;
    } else {
        uint32_t index = (uint32_t)PyList_GET_SIZE(missing);
        int full = table_insert(seen, key, key_len, hash, (const char *)&index, 4);
        if (full) {
            if (full > 0)
                PyErr_SetString(PyExc_MemoryError, "scan(): too much new text in one batch");
            return -1;
        }
        PyObject *key_str = PyUnicode_DecodeUTF8(key, key_len, NULL);
        if (!key_str || PyList_Append(missing, key_str) < 0) {
            Py_XDECREF(key_str);
            return -1;
        }
        Py_DECREF(key_str);
        ref = index | MISSING_BIT;
    }
    return append(&self->refs, &self->refs_len, &self->refs_cap, (const char *)&ref, 4);
}

static Py_ssize_t scan_text(SegmentTable *self, Table *seen, PyObject *missing, const char *text, Py_ssize_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    Py_ssize_t start = 0, at = 0, segments = 0;
    uint32_t previous = len ? next_char(s, &at) : 0;
    while (at < len) {
        Py_ssize_t here = at;
        uint32_t current = next_char(s, &at);
        if (cuttable(&self->joinable, &self->known, previous, current)) {
            if (scan_segment(self, seen, missing, text + start, here - start) < 0)
                return -1;
            start = here;
            segments++;
        }
        previous = current;
    }
    if (len) {
        if (scan_segment(self, seen, missing, text + start, len - start) < 0)
            return -1;
        segments++;
    }
    return segments;
}

PyDoc_STRVAR(scan_doc, "scan(texts) -> missing\n\n"
             "Cut each text into segments; return the distinct segments not in the table, first seen\n"
             "first. join() after it puts each text's ids together.");

static PyObject *SegmentTable_scan(SegmentTable *self, PyObject *texts)
{
    if (check_initialised(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(texts, "texts must be a sequence of str");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *missing = PyList_New(0);
    Table seen;
    int seen_ok = table_init(&seen, 1 << 10) == 0;
    Py_ssize_t *ends = PyMem_Realloc(self->text_ends, (n + 1) * sizeof(Py_ssize_t));
    if (ends)
        self->text_ends = ends;
    self->scanned = -1;
    self->refs_len = 0;
    if (!missing || !seen_ok || !ends) {
        if (!ends)
            PyErr_NoMemory();
        goto error;
    }
    ends[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "texts must be str, not %.100s", Py_TYPE(item)->tp_name);
            goto error;
        }
        Py_ssize_t len, segments;
        const char *text = PyUnicode_AsUTF8AndSize(item, &len);
        if (!text || (segments = scan_text(self, &seen, missing, text, len)) < 0)
            goto error;
        ends[i + 1] = ends[i] + segments;
    }
    table_free(&seen);
    Py_DECREF(seq);
    self->scanned = n;
    return missing;
error:
    if (seen_ok)
        table_free(&seen);
    Py_XDECREF(missing);
    Py_DECREF(seq);
    return NULL;
}

static int check_fresh(PyObject *keys, PyObject *values)
{
    if (!PyList_Check(keys) || !PyList_Check(values) || PyList_GET_SIZE(keys) != PyList_GET_SIZE(values)) {
        PyErr_SetString(PyExc_TypeError, "need two lists of the same length: segments (str) and their ids (bytes)");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        if (!PyUnicode_Check(PyList_GET_ITEM(keys, i)) || !PyBytes_Check(PyList_GET_ITEM(values, i))) {
            PyErr_SetString(PyExc_TypeError, "segments must be str and their ids bytes");
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(add_doc, "add(segments, ids) -> int\n\n"
             "Keep the segments (str) of at most max_key_chars characters with their ids (bytes) while\n"
             "the table has room (a full table keeps what it has); returns how many were added.");

static PyObject *SegmentTable_add(SegmentTable *self, PyObject *args)
{
    PyObject *keys, *values;
    if (check_initialised(self) < 0 || !PyArg_ParseTuple(args, "OO", &keys, &values) || check_fresh(keys, values) < 0)
        return NULL;
    Py_ssize_t added = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys) && (Py_ssize_t)self->table.count < self->max_entries; i++) {
        Py_ssize_t len;
        const char *key = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, i), &len);
        if (!key)
            return NULL;
        if (utf8_chars(key, len) > self->max_key_chars)
            continue;
        uint64_t hash = hash_bytes(key, len);
        if (table_find(&self->table, key, len, hash) >= 0)
            continue;
        PyObject *value = PyList_GET_ITEM(values, i);
        int full = table_insert(&self->table, key, len, hash, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
        if (full < 0)
            return NULL;
        if (full)
            break;
        added++;
    }
    return PyLong_FromSsize_t(added);
}

PyDoc_STRVAR(join_doc, "join(texts, fresh) -> list\n\n"
             "The ids (bytes) of each text of the scan() just before: its segments' ids, from the table\n"
             "or, for scan's missing[j], fresh[j].");

static PyObject *SegmentTable_join(SegmentTable *self, PyObject *args)
{
    PyObject *texts, *fresh;
    if (check_initialised(self) < 0 || !PyArg_ParseTuple(args, "OO!", &texts, &PyList_Type, &fresh))
        return NULL;
    Py_ssize_t n = PyObject_Length(texts);
    if (n < 0)
        return NULL;
    if (self->scanned < 0 || n != self->scanned) {
        PyErr_SetString(PyExc_ValueError, "join() takes the texts of the scan() just before it");
        return NULL;
    }
    const uint32_t *refs = (const uint32_t *)self->refs;
    Py_ssize_t fresh_count = PyList_GET_SIZE(fresh);
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        self->out_len = 0;
        for (Py_ssize_t r = self->text_ends[i]; r < self->text_ends[i + 1]; r++) {
            const char *ids;
            size_t ids_len;
            if (refs[r] & MISSING_BIT) {
                Py_ssize_t j = refs[r] & ~MISSING_BIT;
                PyObject *item = j < fresh_count ? PyList_GET_ITEM(fresh, j) : NULL;
                if (!item || !PyBytes_Check(item)) {
                    PyErr_Format(PyExc_ValueError, "join(): fresh[%zd] is not the ids (bytes) of missing[%zd]", j, j);
                    goto error;
                }
                ids = PyBytes_AS_STRING(item);
                ids_len = PyBytes_GET_SIZE(item);
            } else {
                uint32_t lengths[2];
                memcpy(lengths, self->table.arena + refs[r], 8);
                ids = self->table.arena + refs[r] + 8 + lengths[0];
                ids_len = lengths[1];
            }
            if (append(&self->out, &self->out_len, &self->out_cap, ids, ids_len) < 0)
                goto error;
        }
        PyObject *joined = PyBytes_FromStringAndSize(self->out, (Py_ssize_t)self->out_len);
        if (!joined)
            goto error;
        PyList_SET_ITEM(out, i, joined);
    }
    self->scanned = -1;
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef SegmentTable_methods[] = {
    {"scan", (PyCFunction)SegmentTable_scan, METH_O, scan_doc},
    {"add", (PyCFunction)SegmentTable_add, METH_VARARGS, add_doc},
    {"join", (PyCFunction)SegmentTable_join, METH_VARARGS, join_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods SegmentTable_as_sequence = {.sq_length = (lenfunc)SegmentTable_len};

static PyTypeObject SegmentTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "megatron_iiet.data._segment_table.SegmentTable",
    .tp_doc = PyDoc_STR("SegmentTable(joinable_pairs, max_entries, max_key_chars, known_chars=None): memoised segment ids"),
    .tp_basicsize = sizeof(SegmentTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SegmentTable_init,
    .tp_dealloc = (destructor)SegmentTable_dealloc,
    .tp_methods = SegmentTable_methods,
    .tp_as_sequence = &SegmentTable_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_segment_table",
    "Native segment table for megatron_iiet.data.bpe_cache.", -1, NULL,
};

PyMODINIT_FUNC PyInit__segment_table(void)
{
    if (PyType_Ready(&SegmentTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "SegmentTable", (PyObject *)&SegmentTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
