/* divtrace._index: records.jsonl's lines, as divtrace writes them, into the reader's compact index.

   Reading a trace is what bisect spends its time on: json.loads builds a dict for every record and value and a
   list for every argument list, and the index keeps a few of those objects. This reads the bytes directly and
   builds only what the index keeps, with the same checks as Trace._index_fast (divtrace/trace/reader.py),
   which it mirrors field by field.

   It accepts only lines in the exact form the writer emits (records.record_compact through the compact
   encoder: keys in the writer's order, no whitespace, ASCII, no NaN/Infinity, no escapes in the names it
   keeps; escapes in strings it skips are checked as json.loads takes them). Anything
   else, valid JSON or not, makes it give up (False), and the caller starts again with the Python readers,
   which accept or name the bad line. So it never accepts what the Python readers reject; tests compare it
   with them on mutated traces (tests/test_bisect_scale.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ctype.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64 /* deeper argument structures: given up on (json would recurse; the Python readers decide) */
#define INTERN_SLOTS 4096

typedef struct {
    const char *p, *end; /* end: the line's '\n' (never a valid byte inside a token, so scans stop there) */
} cursor;

/* Interned strings (op and module names, keys, dtype and shard names): one object per distinct name. The
   table never lets go of a string while a read is running: callers hold borrowed references across a record. */
typedef struct {
    PyObject *str[INTERN_SLOTS];
    uint32_t hash[INTERN_SLOTS];
    PyObject *overflow; /* a list of the strings that found no free slot (a crowded table), or NULL */
} interns;

static int lit(cursor *c, const char *s, size_t n) {
    if (c->p > c->end || (size_t)(c->end - c->p) < n || memcmp(c->p, s, n) != 0)
        return 0;
    c->p += n;
    return 1;
}
#define LIT(c, s) lit((c), (s), sizeof(s) - 1)

/* A JSON integer (no fraction, no exponent) that fits in 62 bits. */
static int parse_int(cursor *c, long long *out) {
    const char *p = c->p;
    int neg = 0;
    if (*p == '-')
        neg = 1, p++;
    if (*p < '0' || *p > '9')
        return 0;
    long long v = 0;
    if (*p == '0') {
        p++;
    } else {
        int digits = 0;
        while (*p >= '0' && *p <= '9') {
            if (++digits > 18)
                return 0;
            v = v * 10 + (*p++ - '0');
        }
    }
    if (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9'))
        return 0;
    c->p = p;
    *out = neg ? -v : v;
    return 1;
}

/* The bytes of a JSON string without escapes or control or non-ASCII characters: [*s, *s + *n). */
static int scan_str(cursor *c, const char **s, Py_ssize_t *n) {
    if (*c->p != '"')
        return 0;
    const char *p = c->p + 1, *q = p;
    while (*q != '"') {
        unsigned char ch = (unsigned char)*q;
        if (ch < 0x20 || ch >= 0x80 || ch == '\\')
            return 0; /* includes the line's '\n' */
        q++;
    }
    *s = p, *n = q - p;
    c->p = q + 1;
    return 1;
}

/* A JSON string whose text is not kept, checked and skipped: escapes are allowed here (\" \\ \/ \b \f \n \r \t
   \uXXXX, as json.loads takes them), control and non-ASCII bytes are not (the writer escapes them). */
static int skip_str(cursor *c) {
    if (*c->p != '"')
        return 0;
    const char *q = c->p + 1;
    while (*q != '"') {
        unsigned char ch = (unsigned char)*q;
        if (ch < 0x20 || ch >= 0x80)
            return 0; /* includes the line's '\n' */
        if (ch != '\\') {
            q++;
            continue;
        }
        char e = q[1];
        if (e == 'u') {
            for (int i = 2; i < 6; i++) /* stops at the first non-hex byte: never past the line's '\n' */
                if (!isxdigit((unsigned char)q[i]))
                    return 0;
            q += 6;
        } else if (e != 0 && strchr("\"\\/bfnrt", e)) {
            q += 2;
        } else {
            return 0;
        }
    }
    c->p = q + 1;
    return 1;
}

static PyObject *new_str(const char *s, Py_ssize_t n) { return PyUnicode_DecodeASCII(s, n, NULL); }

/* A borrowed interned string, or NULL with an exception set. */
static PyObject *intern_str(interns *t, const char *s, Py_ssize_t n) {
    uint32_t h = 2166136261u;
    for (Py_ssize_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    for (uint32_t k = 0; k < 8; k++) {
        uint32_t slot = (h + k) % INTERN_SLOTS;
        PyObject *o = t->str[slot];
        if (o == NULL) {
            o = new_str(s, n);
            if (o == NULL)
                return NULL;
            t->str[slot] = o, t->hash[slot] = h;
            return o;
        }
        if (t->hash[slot] == h && PyUnicode_GET_LENGTH(o) == n && memcmp(PyUnicode_DATA(o), s, n) == 0)
            return o;
    }
    /* the table is crowded here: a string of its own, kept until the read ends */
    if (t->overflow == NULL && (t->overflow = PyList_New(0)) == NULL)
        return NULL;
    PyObject *o = new_str(s, n);
    int bad = o == NULL || PyList_Append(t->overflow, o) < 0;
    Py_XDECREF(o);
    return bad ? NULL : o;
}

/* Any JSON value in the compact form, checked and skipped. */
static int skip_value(cursor *c, int depth) {
    long long dummy;
    char ch = *c->p;
    if (ch == '"')
        return skip_str(c);
    if (ch == '{' || ch == '[') {
        char close = ch == '{' ? '}' : ']';
        if (depth >= MAX_DEPTH)
            return 0;
        c->p++;
        if (*c->p == close)
            return c->p++, 1;
        for (;;) {
            if (ch == '{' && !(skip_str(c) && LIT(c, ":")))
                return 0;
            if (!skip_value(c, depth + 1))
                return 0;
            if (*c->p == close)
                return c->p++, 1;
            if (!LIT(c, ","))
                return 0;
        }
    }
    if (LIT(c, "true") || LIT(c, "false") || LIT(c, "null"))
        return 1;
    if (parse_int(c, &dummy))
        return 1;
    /* a float: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, or a long integer */
    const char *p = c->p, *digits;
    if (*p == '-')
        p++;
    digits = p;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (*p >= '0' && *p <= '9')
            p++;
    else
        return 0;
    /* json.loads refuses integers longer than sys.get_int_max_str_digits() (4300 by default, 640 at the
       least): give up on long ones and let Python decide */
    if (*p != '.' && *p != 'e' && *p != 'E' && p - digits > 640)
        return 0;
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9')
            return 0;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (*p < '0' || *p > '9')
            return 0;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    c->p = p;
    return 1;
}

typedef PyObject *(*item_reader)(cursor *c, void *ctx, int *gave_up);

/* [item, ...] as a list, each item read by `item` (a new reference, or NULL: *gave_up set when the item is not
   in the writer's form, else an error). */
static PyObject *list_of(cursor *c, item_reader item, void *ctx, int *gave_up) {
    if (!LIT(c, "["))
        return *gave_up = 1, NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || LIT(c, "]"))
        return out;
    for (;;) {
        PyObject *o = item(c, ctx, gave_up);
        if (o == NULL || PyList_Append(out, o) < 0) {
            Py_XDECREF(o);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(o);
        if (LIT(c, "]"))
            return out;
        if (!LIT(c, ",")) {
            Py_DECREF(out);
            return *gave_up = 1, NULL;
        }
    }
}

static PyObject *int_item(cursor *c, void *lo, int *gave_up) {
    long long v;
    if (!parse_int(c, &v) || v < *(long long *)lo)
        return *gave_up = 1, NULL;
    return PyLong_FromLongLong(v);
}

/* [int, ...] as a list of ints, each >= lo. */
static PyObject *int_list(cursor *c, long long lo, int *gave_up) { return list_of(c, int_item, &lo, gave_up); }

/* A tuple the cyclic GC never scans: it holds only ints, strings and such tuples, so it can be in no cycle
   (CPython itself untracks such tuples when a collection first meets them). The index is hundreds of thousands
   of these; left tracked, every later collection walked them all (a second, on two 100k-record traces). */
static PyObject *untracked(PyObject *tuple) {
    if (tuple != NULL && PyObject_GC_IsTracked(tuple))
        PyObject_GC_UnTrack(tuple);
    return tuple;
}

/* [int, ...] as an untracked tuple of ints, each >= lo. */
static PyObject *int_tuple(cursor *c, long long lo, int *gave_up) {
    PyObject *list = int_list(c, lo, gave_up);
    if (list == NULL)
        return NULL;
    PyObject *t = PyList_AsTuple(list);
    Py_DECREF(list);
    return untracked(t);
}

typedef struct {
    int full;
    PyObject *dtype_info, *vkey, *vsrc, *vprod, *vblob, *vderived, *calls, *open_, *counts;
    PyObject *rcall, *rop, *rin, *rout, *module_call;
    PyObject *str_ops, *str_children, *str_exit_index, *str_outputs;
    PyObject *last_ops; /* the ops list of call last_call (most op records follow one another in one call) */
    PyObject *unknown_dtype; /* borrowed from the intern table: a dtype name dtype_info does not hold */
    long long last_call;
    interns *names;
} index_state;

static PyObject *pair_item(cursor *c, void *state, int *gave_up) {
    index_state *S = (index_state *)state;
    const char *s;
    Py_ssize_t n;
    long long vid;
    if (!(LIT(c, "[") && scan_str(c, &s, &n) && LIT(c, ",") && parse_int(c, &vid) && LIT(c, "]")))
        return *gave_up = 1, NULL;
    PyObject *key = intern_str(S->names, s, n);
    PyObject *v = key ? PyLong_FromLongLong(vid) : NULL;
    PyObject *pair = v ? untracked(PyTuple_Pack(2, key, v)) : NULL;
    Py_XDECREF(v);
    return pair;
}

/* [["key", vid], ...] as a list of (key, vid) tuples (the vids are checked once the record's values are in). */
static PyObject *pairs(index_state *S, cursor *c, int *gave_up) { return list_of(c, pair_item, S, gave_up); }

/* 1 when every pair's vid is a defined value, else 0 (or -1). */
static int pairs_defined(index_state *S, PyObject *list) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        int r = PyDict_Contains(S->vkey, PyTuple_GET_ITEM(PyList_GET_ITEM(list, i), 1));
        if (r != 1)
            return r;
    }
    return 1;
}

static int is_hex32(const char *s, Py_ssize_t n) {
    if (n != 32)
        return 0;
    for (int i = 0; i < 32; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

static int is_shard_name(const char *s, Py_ssize_t n) { /* tensors-\d{5,}\.safetensors */
    const Py_ssize_t pre = 8, suf = 12;
    if (n < pre + 5 + suf || memcmp(s, "tensors-", pre) != 0 || memcmp(s + n - suf, ".safetensors", suf) != 0)
        return 0;
    for (Py_ssize_t i = pre; i < n - suf; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* One value object of a record's "V" list. Returns 1 (added), 0 (give up) or -1 (error). */
static int value(index_state *S, cursor *c, long long index, int is_op, PyObject *index_obj, int *produced) {
    const char *s, *hs, *bs = NULL, *fs = NULL;
    Py_ssize_t n, hn, bn = 0, fn = 0;
    long long vid, producer = -1;
    int gave_up = 0, has_p = 0, derived = 0;
    if (!(LIT(c, "{\"v\":") && parse_int(c, &vid) && vid >= 0 && LIT(c, ",\"d\":") && scan_str(c, &s, &n)))
        return 0;
    PyObject *dname = intern_str(S->names, s, n);
    if (dname == NULL)
        return -1;
    PyObject *info = PyDict_GetItemWithError(S->dtype_info, dname);
    if (info == NULL) {
        if (PyErr_Occurred())
            return -1;
        S->unknown_dtype = dname; /* not looked up yet (the caller may, and read again) */
        return 0;
    }
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2) /* None: not a dtype of this torch */
        return 0;
    if (!LIT(c, ",\"s\":"))
        return 0;
    PyObject *shape = int_tuple(c, 0, &gave_up);
    if (shape == NULL)
        return gave_up ? 0 : -1;
    int ok = LIT(c, ",\"h\":") && scan_str(c, &hs, &hn) && is_hex32(hs, hn);
    /* the optional keys, in the writer's order: p, t, dev, m or M, b and f, r */
    if (ok && LIT(c, ",\"p\":")) {
        has_p = 1;
        ok = parse_int(c, &producer) && is_op && producer == index;
    }
    if (ok && LIT(c, ",\"t\":")) {
        PyObject *stride = int_list(c, LLONG_MIN, &gave_up);
        if (stride == NULL && !gave_up) {
            Py_DECREF(shape);
            return -1;
        }
        ok = stride != NULL && PyList_GET_SIZE(stride) == PyTuple_GET_SIZE(shape);
        Py_XDECREF(stride);
    }
    if (ok && LIT(c, ",\"dev\":"))
        ok = skip_str(c);
    if (ok && LIT(c, ",\"m\":")) { /* five items */
        ok = LIT(c, "[");
        for (int i = 0; ok && i < 5; i++)
            ok = skip_value(c, 1) && lit(c, i < 4 ? "," : "]", 1);
    } else if (ok && LIT(c, ",\"M\":")) {
        ok = *c->p == '{' && skip_value(c, 0);
    }
    if (ok && LIT(c, ",\"b\":"))
        ok = scan_str(c, &bs, &bn) && LIT(c, ",\"f\":") && scan_str(c, &fs, &fn);
    if (ok && LIT(c, ",\"r\":1"))
        derived = 1, ok = has_p && bs == NULL;
    ok = ok && LIT(c, "}");
    if (ok)
        ok = S->full && !derived ? bs != NULL && is_shard_name(fs, fn) : bs == NULL;
    if (!ok) {
        Py_DECREF(shape);
        return 0;
    }
    PyObject *v = PyLong_FromLongLong(vid);
    PyObject *h = v ? new_str(hs, hn) : NULL;
    PyObject *key = h ? untracked(PyTuple_Pack(3, PyTuple_GET_ITEM(info, 0), shape, h)) : NULL;
    Py_DECREF(shape);
    Py_XDECREF(h);
    int r = -1, seen = key ? PyDict_Contains(S->vkey, v) : -1;
    if (seen == 1)
        r = 0;
    else if (seen == 0 && PyDict_SetItem(S->vkey, v, key) == 0
             && PyDict_SetItem(has_p ? S->vprod : S->vsrc, v, index_obj) == 0) {
        r = 1;
        if (derived && PySet_Add(S->vderived, v) < 0)
            r = -1;
        if (r == 1 && S->full && !derived) {
            PyObject *b = new_str(bs, bn), *f = b ? intern_str(S->names, fs, fn) : NULL;
            PyObject *bf = f ? untracked(PyTuple_Pack(2, b, f)) : NULL;
            if (bf == NULL || PyDict_SetItem(S->vblob, v, bf) < 0)
                r = -1;
            Py_XDECREF(b);
            Py_XDECREF(bf);
        }
    }
    Py_XDECREF(key);
    Py_XDECREF(v);
    if (r == 1 && has_p)
        ++*produced;
    return r;
}

/* The record's "V" list, when there is one: 1, 0 (give up) or -1 (error). */
static int values(index_state *S, cursor *c, long long index, int is_op, PyObject *index_obj, int *produced) {
    if (!LIT(c, ",\"V\":["))
        return 1;
    if (LIT(c, "]"))
        return 1;
    for (;;) {
        int r = value(S, c, index, is_op, index_obj, produced);
        if (r != 1)
            return r;
        if (LIT(c, "]"))
            return 1;
        if (!LIT(c, ","))
            return 0;
    }
}

/* Every vid of an op's inputs defined, every output produced by this op (and every value it produced among
   them). 1, 0 or -1. */
static int op_links(index_state *S, PyObject *inputs, PyObject *outputs, long long index, int produced) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); i++) {
        int r = PyDict_Contains(S->vkey, PyTuple_GET_ITEM(inputs, i));
        if (r != 1)
            return r;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(outputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyDict_GetItemWithError(S->vprod, PyTuple_GET_ITEM(outputs, i));
        if (p == NULL || PyLong_AsLongLong(p) != index)
            return PyErr_Occurred() ? -1 : 0;
    }
    if (n < 2)
        return produced == n;
    PyObject *distinct = PySet_New(outputs); /* an output listed twice is one value */
    if (distinct == NULL)
        return -1;
    int r = produced == PySet_GET_SIZE(distinct);
    Py_DECREF(distinct);
    return r;
}

#define TRY(x)                                                                                                 \
    do {                                                                                                       \
        int r_ = (x);                                                                                          \
        if (r_ != 1)                                                                                           \
            return r_;                                                                                         \
    } while (0)

static int appended(PyObject *list, PyObject *item) { return PyList_Append(list, item) < 0 ? -1 : 1; }

/* The rest of an op record, after its "c": 1, 0 (give up) or -1 (error). `cid`, `index_obj`: the call id and
   the record index as objects. */
static int op_record(index_state *S, cursor *c, long long index, long long call_id, PyObject *cid,
                     PyObject *index_obj, PyObject **inputs, PyObject **outputs) {
    const char *s;
    Py_ssize_t n;
    int gave_up = 0, produced = 0;
    if (!(LIT(c, ",\"op\":") && scan_str(c, &s, &n)))
        return 0;
    PyObject *op = intern_str(S->names, s, n);
    if (op == NULL)
        return -1;
    if (!(LIT(c, ",\"a\":") && *c->p == '[' && skip_value(c, 0) && LIT(c, ",\"o\":") && skip_value(c, 0)))
        return 0;
    if (LIT(c, ",\"kw\":") && !(*c->p == '{' && skip_value(c, 0)))
        return 0;
    if (!LIT(c, ",\"in\":"))
        return 0;
    if ((*inputs = int_tuple(c, LLONG_MIN, &gave_up)) == NULL)
        return gave_up ? 0 : -1;
    if (!LIT(c, ",\"out\":"))
        return 0;
    if ((*outputs = int_tuple(c, LLONG_MIN, &gave_up)) == NULL)
        return gave_up ? 0 : -1;
    TRY(values(S, c, index, 1, index_obj, &produced));
    if (!LIT(c, "}") || c->p != c->end)
        return 0;
    TRY(PySet_Contains(S->open_, cid));
    TRY(op_links(S, *inputs, *outputs, index, produced));
    if (S->last_ops == NULL || S->last_call != call_id) {
        PyObject *mc = PyDict_GetItemWithError(S->calls, cid);
        if (mc == NULL)
            return PyErr_Occurred() ? -1 : 0;
        Py_XDECREF(S->last_ops);
        S->last_ops = PyObject_GetAttr(mc, S->str_ops);
        if (S->last_ops == NULL)
            return -1;
        S->last_call = call_id;
    }
    TRY(appended(S->last_ops, index_obj));
    TRY(appended(S->rcall, cid));
    TRY(appended(S->rop, op));
    TRY(appended(S->rin, *inputs));
    return appended(S->rout, *outputs);
}

static int module_record_appended(index_state *S, PyObject *cid) {
    TRY(appended(S->rcall, cid));
    TRY(appended(S->rop, Py_None));
    TRY(appended(S->rin, Py_None));
    return appended(S->rout, Py_None);
}

/* The rest of a module-enter record, after its "c". */
static int enter_record(index_state *S, cursor *c, long long index, PyObject *cid, PyObject *index_obj,
                        PyObject **items) {
    const char *s;
    Py_ssize_t n;
    long long call, parent = -1;
    int gave_up = 0, has_parent = 0, produced = 0;
    if (!(LIT(c, ",\"m\":") && scan_str(c, &s, &n)))
        return 0;
    PyObject *module = intern_str(S->names, s, n);
    if (module == NULL)
        return -1;
    if (!(LIT(c, ",\"n\":") && parse_int(c, &call) && call >= 0 && LIT(c, ",\"in\":")))
        return 0;
    if ((*items = pairs(S, c, &gave_up)) == NULL)
        return gave_up ? 0 : -1;
    if (LIT(c, ",\"p\":")) {
        if (!parse_int(c, &parent))
            return 0;
        has_parent = 1;
    }
    TRY(values(S, c, index, 0, index_obj, &produced));
    if (!LIT(c, "}") || c->p != c->end)
        return 0;
    TRY(pairs_defined(S, *items));
    int known = PyDict_Contains(S->calls, cid);
    if (known != 0)
        return known < 0 ? -1 : 0;
    PyObject *count = PyDict_GetItemWithError(S->counts, module);
    if (count == NULL && PyErr_Occurred())
        return -1;
    if ((count ? PyLong_AsLongLong(count) : 0) != call)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *parent_obj = has_parent ? PyLong_FromLongLong(parent) : Py_NewRef(Py_None);
    if (parent_obj == NULL)
        return -1;
    int r = has_parent ? PySet_Contains(S->open_, parent_obj) : 1;
    PyObject *next = NULL, *call_obj = NULL, *mc = NULL, *children = NULL;
    if (r == 1) {
        r = -1;
        next = PyLong_FromLongLong(call + 1), call_obj = PyLong_FromLongLong(call);
        if (next && call_obj)
            mc = PyObject_CallFunctionObjArgs(S->module_call, cid, module, call_obj, parent_obj, index_obj, *items,
                                              NULL);
        if (mc && PyDict_SetItem(S->counts, module, next) == 0 && PyDict_SetItem(S->calls, cid, mc) == 0
            && PySet_Add(S->open_, cid) == 0) {
            r = 1;
            if (has_parent) {
                PyObject *up = PyDict_GetItemWithError(S->calls, parent_obj);
                children = up ? PyObject_GetAttr(up, S->str_children) : NULL;
                r = children ? appended(children, cid) : -1;
            }
        }
    }
    Py_XDECREF(children);
    Py_XDECREF(mc);
    Py_XDECREF(call_obj);
    Py_XDECREF(next);
    Py_DECREF(parent_obj);
    TRY(r);
    return module_record_appended(S, cid);
}

/* The rest of a module-exit record, after its "c". */
static int exit_record(index_state *S, cursor *c, long long index, PyObject *cid, PyObject *index_obj,
                       PyObject **items) {
    int gave_up = 0, produced = 0;
    if (!LIT(c, ",\"out\":"))
        return 0;
    if ((*items = pairs(S, c, &gave_up)) == NULL)
        return gave_up ? 0 : -1;
    if (LIT(c, ",\"err\":") && !skip_str(c))
        return 0;
    TRY(values(S, c, index, 0, index_obj, &produced));
    if (!LIT(c, "}") || c->p != c->end)
        return 0;
    TRY(pairs_defined(S, *items));
    TRY(PySet_Contains(S->open_, cid));
    PyObject *mc = PyDict_GetItemWithError(S->calls, cid);
    if (mc == NULL || PyObject_SetAttr(mc, S->str_exit_index, index_obj) < 0
        || PyObject_SetAttr(mc, S->str_outputs, *items) < 0 || PySet_Discard(S->open_, cid) < 0)
        return -1;
    return module_record_appended(S, cid);
}

/* One line: 1 (read into the index), 0 (give up) or -1 (error). */
static int record(index_state *S, cursor *c, long long index) {
    long long i, call_id;
    if (!LIT(c, "{\"k\":\""))
        return 0;
    if (c->p >= c->end)
        return 0;
    char kind = *c->p++;
    if (!(LIT(c, "\",\"i\":") && parse_int(c, &i) && i == index && LIT(c, ",\"c\":") && parse_int(c, &call_id)))
        return 0;
    PyObject *index_obj = PyLong_FromLongLong(index), *cid = PyLong_FromLongLong(call_id);
    PyObject *a = NULL, *b = NULL;
    int r = -1;
    if (index_obj && cid)
        r = kind == 'o'   ? op_record(S, c, index, call_id, cid, index_obj, &a, &b)
            : kind == 'e' ? enter_record(S, c, index, cid, index_obj, &a)
            : kind == 'x' ? exit_record(S, c, index, cid, index_obj, &a)
                          : 0;
    Py_XDECREF(index_obj);
    Py_XDECREF(cid);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

/* index_records(body, full, dtype_info, vkey, vsrc, vprod, vblob, vderived, calls, open, counts, rcall, rop,
   rin, rout, module_call) -> bool. body: whole lines (each ending in '\n'). */
static PyObject *py_index_records(PyObject *self, PyObject *args) {
    Py_buffer body;
    index_state S; /* the intern table (48 KiB) lives on the heap: threads may have small stacks */
    memset(&S, 0, sizeof S);
    if (!PyArg_ParseTuple(args, "y*pO!O!O!O!O!O!O!O!O!O!O!O!O!O", &body, &S.full, &PyDict_Type, &S.dtype_info,
                          &PyDict_Type, &S.vkey, &PyDict_Type, &S.vsrc, &PyDict_Type, &S.vprod, &PyDict_Type,
                          &S.vblob, &PySet_Type, &S.vderived, &PyDict_Type, &S.calls, &PySet_Type, &S.open_,
                          &PyDict_Type, &S.counts, &PyList_Type, &S.rcall, &PyList_Type, &S.rop, &PyList_Type,
                          &S.rin, &PyList_Type, &S.rout, &S.module_call))
        return NULL;
    S.names = (interns *)PyMem_Calloc(1, sizeof(interns));
    if (S.names == NULL) {
        PyBuffer_Release(&body);
        return PyErr_NoMemory();
    }
    S.str_ops = PyUnicode_InternFromString("ops");
    S.str_children = PyUnicode_InternFromString("children");
    S.str_exit_index = PyUnicode_InternFromString("exit_index");
    S.str_outputs = PyUnicode_InternFromString("outputs");
    int r = S.str_ops && S.str_children && S.str_exit_index && S.str_outputs ? 1 : -1;
    const char *p = (const char *)body.buf, *end = p + body.len;
    long long index = 0;
    if (body.len && end[-1] != '\n')
        r = 0;
    while (r == 1 && p < end) {
        cursor c;
        c.p = p;
        c.end = (const char *)memchr(p, '\n', end - p);
        r = record(&S, &c, index++);
        p = c.end + 1;
    }
    PyObject *unknown = r == 0 && S.unknown_dtype ? Py_NewRef(S.unknown_dtype) : NULL;
    Py_XDECREF(S.last_ops);
    Py_XDECREF(S.str_ops);
    Py_XDECREF(S.str_children);
    Py_XDECREF(S.str_exit_index);
    Py_XDECREF(S.str_outputs);
    for (int i = 0; i < INTERN_SLOTS; i++)
        Py_XDECREF(S.names->str[i]);
    Py_XDECREF(S.names->overflow);
    PyMem_Free(S.names);
    PyBuffer_Release(&body);
    if (r < 0)
        return NULL;
    return unknown ? unknown : PyBool_FromLong(r);
}

static PyMethodDef methods[] = {
    {"index_records", py_index_records, METH_VARARGS,
     "index_records(body, full, dtype_info, vkey, vsrc, vprod, vblob, vderived, calls, open, counts, rcall, rop, "
     "rin, rout, module_call) -> True when every line was read into the index, False when one is not in the "
     "writer's exact form (the index is then partly filled: start again with the Python readers), or a dtype "
     "name that dtype_info does not hold (look it up, clear the index and read again)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_index", "divtrace's records.jsonl index reader", -1,
                                    methods};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
